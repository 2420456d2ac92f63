"""A pipeline stage in the Megatron shape: each micro-batch's input is a receive buffer made a leaf
that requires grad (its gradient is sent back to the previous stage), and the schedule keeps one
record per micro-batch with the loss, never detached.

The loss's graph ends in the receive buffer's ``AccumulateGrad``, which holds the buffer, and the
buffer holds its ``.grad``: every kept record pins both. Dead after backward; repaired in
``detach``, after which memory stays flat.
"""

import torch
from torch import nn

MICRO, SEQ, HIDDEN = 2, 8, 64

EXPECT_HOLDER = "losses_reduced[*]"
EXPECT_OUTCOME_DETACH = "repaired"
PINNED_PER_STEP = 2 * MICRO * SEQ * HIDDEN * 4  # the receive buffer and its .grad, float32

torch.set_num_threads(1)


class LastStage:
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.losses_reduced: list[dict[str, object]] = []
        self.grads_sent: list[float] = []

    def receive(self) -> torch.Tensor:
        recv = torch.empty(MICRO, SEQ, HIDDEN)
        recv.normal_()  # what the previous stage sent
        return recv.requires_grad_()

    def step(self, index: int) -> None:
        recv = self.receive()
        loss = self.model(recv).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.grads_sent.append(recv.grad.norm().item())  # sent back to the previous stage
        self.opt.step()
        self.losses_reduced.append({"micro_batch": index, "loss": loss})  # the leak: loss.detach()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    stage = LastStage()
    for index in range(6):
        stage.step(index)
    return {name: p.detach().clone() for name, p in stage.model.named_parameters()}


RESULT = main()
