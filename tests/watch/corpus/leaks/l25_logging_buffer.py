"""``logger.info("loss %s", loss)`` with a buffering handler: the ``LogRecord`` keeps its ``args``
(the loss tensor, formatted only when the buffer is flushed). The tensor sits in the standard
library's ``LogRecord.args`` tuple: reported, not repairable."""

import logging
import logging.handlers

import torch
from torch import nn

EXPECT_HOLDER = "buffer[*]"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)

HANDLER = logging.handlers.BufferingHandler(capacity=1000)
# a logger of the program's own, outside logging's registry: no other handler (pytest's capture included)
# sees its records
LOG = logging.Logger("gradguard-corpus.l25", level=logging.INFO)
LOG.addHandler(HANDLER)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(4):
            loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            LOG.info("step %d loss %s", step, loss)
    finally:
        LOG.removeHandler(HANDLER)
        HANDLER.close()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
