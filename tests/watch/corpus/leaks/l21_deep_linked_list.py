"""A leak held more than 100 references deep: a hand-made linked list of step records, made of 110
empty nodes at start, each step's record appended at its end. No depth cap may skip it."""

import torch
from torch import nn

EXPECT_HOLDER = "CHAIN"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Node:
    def __init__(self, value: object = None) -> None:
        self.value = value
        self.next: Node | None = None


def append(head: Node, value: object) -> None:
    node = head
    while node.next is not None:
        node = node.next
    node.next = Node(value)


CHAIN = Node()
for _ in range(110):
    append(CHAIN, None)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        append(CHAIN, loss)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
