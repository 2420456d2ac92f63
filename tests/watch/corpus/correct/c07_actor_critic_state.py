"""Actor-critic: the actor's log-probabilities kept on the agent while the critic takes its steps.

A batch of rollouts is sampled under ``no_grad``; the actor's forward (``self.log_probs``) is made
first and kept as state while the critic's optimizer fits the returns in two steps; the advantage
then comes from the updated critic and the actor's loss backwards through ``self.log_probs``. The
kept graph reaches only the actor's parameters.
"""

import torch
from torch import nn

torch.set_num_threads(1)

OBS, ACTIONS, BATCH = 6, 3, 16


class Agent:
    def __init__(self) -> None:
        self.actor = nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, ACTIONS))
        self.critic = nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=1e-2)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=1e-2)
        self.log_probs: torch.Tensor | None = None

    def rollout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs = torch.randn(BATCH, OBS)
        with torch.no_grad():
            probs = self.actor(obs).softmax(-1)
            actions = torch.multinomial(probs, 1).squeeze(-1)
        returns = (actions == obs[:, :ACTIONS].argmax(-1)).float() + 0.1 * obs[:, -1]
        return obs, actions, returns

    def update(self, obs: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor) -> None:
        log_probs = self.actor(obs).log_softmax(-1)
        self.log_probs = log_probs.gather(1, actions[:, None]).squeeze(1)  # kept while the critic trains
        for _ in range(2):
            value_loss = nn.functional.mse_loss(self.critic(obs).squeeze(-1), returns)
            self.critic_opt.zero_grad()
            value_loss.backward()
            self.critic_opt.step()
        with torch.no_grad():
            advantage = returns - self.critic(obs).squeeze(-1)
        actor_loss = -(self.log_probs * advantage).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    agent = Agent()
    for _ in range(2):
        agent.update(*agent.rollout())
    result = {f"actor.{n}": p.detach().clone() for n, p in agent.actor.named_parameters()}
    result.update({f"critic.{n}": p.detach().clone() for n, p in agent.critic.named_parameters()})
    return result


RESULT = main()
