"""REINFORCE as a script: rollouts sampled under ``no_grad``, then the log-probabilities of the
taken actions recomputed with grad for the policy-gradient loss.

A toy contextual bandit over episodes of four decisions: the reward is 1 when the action matches
the argmax of the first observation features. ``EPISODE_RETURNS`` keeps floats only.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

OBS, ACTIONS, EPISODES, HORIZON = 5, 3, 8, 4
policy = nn.Sequential(nn.Linear(OBS, 16), nn.Tanh(), nn.Linear(16, ACTIONS))
opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
EPISODE_RETURNS: list[float] = []
for _ in range(3):
    observations, actions, rewards = [], [], []
    with torch.no_grad():
        for _ in range(HORIZON):
            obs = torch.randn(EPISODES, OBS)
            action = torch.multinomial(policy(obs).softmax(-1), 1).squeeze(-1)
            observations.append(obs)
            actions.append(action)
            rewards.append((action == obs[:, :ACTIONS].argmax(-1)).float())
    rewards_t = torch.stack(rewards)  # (HORIZON, EPISODES)
    returns = rewards_t.flip(0).cumsum(0).flip(0)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6)
    log_probs = policy(torch.stack(observations)).log_softmax(-1)
    taken = log_probs.gather(-1, torch.stack(actions)[..., None]).squeeze(-1)
    loss = -(taken * returns).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    EPISODE_RETURNS.append(rewards_t.sum(0).mean().item())

RESULT = {name: p.detach().clone() for name, p in policy.named_parameters()}
RESULT["returns"] = torch.tensor(EPISODE_RETURNS)
