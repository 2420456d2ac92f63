"""No false alarm on correct programs: training scripts run at module level (their variables are
``__main__``'s globals, kept from one step to the next) and ``torch.compile``'d models, whose graphs the
compiler keeps in its own state; the repair writes nothing into them."""

from __future__ import annotations

import runpy
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradguard

SCRIPTS = {
    "train_step": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        for step in range(5):
            loss = train_step(torch.randn(4, 8))  # the previous step's loss lives on while this one runs
        """,
    "lbfgs": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        x, y = torch.randn(16, 8), torch.randn(16, 1)

        def closure():
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss

        for step in range(4):
            loss = opt.step(closure)
        """,
    "gan": """
        import torch
        torch.manual_seed(0)
        gen, disc = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
        for step in range(4):
            fake = gen(torch.randn(8, 2))
            d_loss = disc(fake.detach()).mean() - disc(torch.randn(8, 4)).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = -disc(fake).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        """,
    "two_steps_per_batch": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(4, 8)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = model(x + 0.01).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        """,
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_at_module_level_raises_no_false_alarm(name: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(SCRIPTS[name]))
    with gradguard.watch(every=1, mode="raise") as scope:
        namespace = runpy.run_path(str(script), run_name="__main__")  # the script is __main__ while it runs
    assert scope.watcher.history() == [] and scope.watcher.audits > 0
    namespace.clear()


def test_torch_compile_raises_no_false_alarm_and_the_repair_writes_nothing_into_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode in ("raise", "detach"):
        with gradguard.watch(every=1, mode=mode) as scope:
            for _ in range(4):
                loss = compiled(torch.randn(4, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        leaks = [e for e in scope.watcher.history() if "torch" in e.holder or "dynamo" in e.holder]
        assert leaks == [], scope.watcher.summary()
    assert not [row for row in gradguard.stats().values() if row.store == "audit"]
    torch._dynamo.reset()
