"""megatron-core adapter on the real package (0.19.x) on CPU: the loss contract at the last stage,
install and restore, enforce() entered before the import, mode off."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
import warnings
from functools import partial
from types import ModuleType
from typing import Any

import pytest
import torch
import wrapt
from _helpers import require_engine
from _megatron import (
    CALC_LOSS_CALL,
    SCHEDULES,
    TIMEOUT_S,
    TinyModel,
    append_line,
    assert_detached_records,
    graph_paths,
    loss_2tuple,
    loss_2tuple_heavy,
    loss_clean,
    loss_detached,
    ns_config,
    run_forward_step,
)

import gradguard
from gradguard.engines import megatron as megatron_adapter

# --------------------------------------------------------------------------------------------------
# 5. The loss contract at the last stage
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_detached_loss_warns_by_default(schedules: ModuleType) -> None:
    with gradguard.enforce(), pytest.warns(gradguard.LossContractWarning, match="does not require grad") as record:
        run = run_forward_step(schedules, loss_detached, n=2)
    contract = [w for w in record if issubclass(w.category, gradguard.LossContractWarning)]
    assert len(contract) == 2  # one per micro-batch: each is a loss that cannot train
    # checked on what forward_step_calc_loss returned: attributed to the schedule's call, not to gradguard
    line = append_line(schedules, CALC_LOSS_CALL)
    assert {(os.path.basename(w.filename), w.lineno) for w in contract} == {("schedules.py", line)}
    # Megatron itself skipped backward (the output needs no grad) and kept going
    assert all(p.grad is None for p in run.model.parameters())
    assert len(run.store) == 2


@pytest.mark.integration
def test_detached_loss_raises_when_configured(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")
    store: list[Any] = []
    with gradguard.enforce(), pytest.raises(gradguard.LossContractError, match="does not require grad"):
        run_forward_step(schedules, loss_detached, n=1, store=store)
    assert len(store) == 1 and gradguard.find_graphs(store) == []  # raised as the call returned
    # a healthy loss passes the same check
    with gradguard.enforce():
        run_forward_step(schedules, loss_clean, n=1, store=store)
    assert len(store) == 2


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["detach", "raise"])
def test_without_is_last_stage_the_loss_func_is_checked(
    schedules: ModuleType, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """combined 1F1B calls forward_step_calc_loss with eight arguments: megatron asks parallel_state
    for the stage, and the adapter checks what loss_func returns, at the loss_func call."""
    monkeypatch.setattr(schedules.parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(schedules.parallel_state, "is_pipeline_last_stage", lambda **_: True)
    model, config, store = TinyModel(), ns_config(), []
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    line = append_line(schedules, "outputs = loss_func(output_tensor)")
    with gradguard.enforce(mode=mode):
        with pytest.warns(gradguard.LossContractWarning, match="does not require grad") as record:
            schedules.forward_step_calc_loss(model, model(x), partial(loss_detached, y), config, None, False, 1, store)
        contract = [w for w in record if issubclass(w.category, gradguard.LossContractWarning)]
        assert [(os.path.basename(w.filename), w.lineno) for w in contract] == [("schedules.py", line)]
        loss, _ = schedules.forward_step_calc_loss(
            model, model(x), partial(loss_clean, y), config, None, False, 1, store
        )
    assert loss.requires_grad  # a healthy loss passes, silently
    assert_detached_records(store, {"lm loss"})
    assert len(store) == 2


@pytest.mark.integration
def test_detached_loss_check_off(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradguard.enforce():
            run = run_forward_step(schedules, loss_detached, n=2)
    assert len(run.store) == 2


@pytest.mark.integration
def test_no_loss_check_under_no_grad(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradguard.enforce(), torch.no_grad():
            run = run_forward_step(schedules, loss_2tuple, n=2, backward=False)
    assert len(run.store) == 2 and gradguard.find_graphs(run.store) == []


@pytest.mark.integration
def test_configure_rejects_unknown_value() -> None:
    """The message names the parameter the user passed, and what it accepts."""
    for bad in ("loud", "strict"):
        with pytest.raises(gradguard.GradGuardError, match=rf"loss_check='{bad}' is not accepted; accepted: 'raise'"):
            megatron_adapter.configure(loss_check=bad)


# --------------------------------------------------------------------------------------------------
# 6. Install / uninstall: identity restored, nesting, the combined-1F1B function-local import
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_exit_restores_the_identical_original(schedules: ModuleType) -> None:
    original = schedules.forward_step_calc_loss
    forward_step, backward_step = schedules.forward_step, schedules.backward_step
    with gradguard.enforce():
        patched = schedules.forward_step_calc_loss
        assert patched is not original and isinstance(patched, wrapt.FunctionWrapper)
        assert patched.__wrapped__ is original
        # nothing else is touched
        assert schedules.forward_step is forward_step and schedules.backward_step is backward_step
    assert schedules.forward_step_calc_loss is original


@pytest.mark.integration
def test_nested_enforce_keeps_the_patch_until_outer_exit(schedules: ModuleType) -> None:
    original = schedules.forward_step_calc_loss
    with gradguard.enforce():
        patched = schedules.forward_step_calc_loss
        with gradguard.enforce(engines=["megatron"]):
            assert schedules.forward_step_calc_loss is patched  # not wrapped twice
        assert schedules.forward_step_calc_loss is patched
        with pytest.raises(KeyError), gradguard.enforce(mode="raise"):
            raise KeyError("inside")
        assert schedules.forward_step_calc_loss is patched
        run = run_forward_step(schedules, loss_2tuple, n=2)  # the outer (detach) mode is back
        assert gradguard.find_graphs(run.store) == []
    assert schedules.forward_step_calc_loss is original


@pytest.mark.integration
def test_combined_1f1b_function_local_import_sees_the_patch(schedules: ModuleType) -> None:
    combined = require_engine("megatron.core.pipeline_parallel.combined_1f1b")
    tree = ast.parse(inspect.getsource(combined))
    local_imports = [
        (func.name, node)
        for func in ast.walk(tree)
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(func)
        if isinstance(node, ast.ImportFrom)
        and node.module == SCHEDULES
        and any(alias.name == "forward_step_calc_loss" for alias in node.names)
    ]
    assert local_imports, "combined_1f1b no longer imports forward_step_calc_loss inside a function"
    top_level = [
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and any(a.name == "forward_step_calc_loss" for a in n.names)
    ]
    assert top_level == [] and "forward_step_calc_loss" not in vars(combined)

    original = schedules.forward_step_calc_loss
    with gradguard.enforce():
        from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss as inside

        assert inside is schedules.forward_step_calc_loss and inside is not original
        assert isinstance(inside, wrapt.FunctionWrapper)
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss as after

    assert after is original


# --------------------------------------------------------------------------------------------------
# 7. enforce() entered before megatron is imported (fresh interpreter)
# --------------------------------------------------------------------------------------------------

BEFORE_IMPORT = textwrap.dedent(
    """
    import gc, sys, warnings, weakref
    warnings.filterwarnings("ignore")
    import torch, wrapt
    import gradguard

    NAME = "megatron.core.pipeline_parallel.schedules"
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules), "megatron already imported"

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
        def set_input_tensor(self, t):
            pass
        def forward(self, x):
            return self.lin(x)

    def run(schedules):
        from types import SimpleNamespace
        config = SimpleNamespace(timers=None, enable_autocast=False, autocast_dtype=torch.float32,
                                 calculate_per_token_loss=False, grad_scale_func=None,
                                 deallocate_pipeline_outputs=False)
        torch.manual_seed(0)
        model, store, acts = Tiny(), [], []
        data = iter([(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(2)])
        def loss_func(y, out):
            loss = torch.nn.functional.mse_loss(out, y)
            return loss, {"lm loss": loss.detach(), "logits": out.mean(), "sq": (out ** 2).mean()}
        def fsf(it, model):
            x, y = next(it)
            out = model(x)
            acts.append(weakref.ref(out))
            return out, lambda o: loss_func(y, o)
        for i in range(2):
            out, _ = schedules.forward_step(fsf, data, model, 2, None, store, config, 1,
                                            current_microbatch=i, is_last_stage=True)
            schedules.backward_step(None, out, None, config)
            del out
        gc.collect()
        return store, sum(r() is not None for r in acts)

    with gradguard.enforce(engines=["megatron"]):
        from megatron.core.pipeline_parallel import schedules
        gc.collect(); gc.freeze()  # keep the collections in run() cheap
        patched = schedules.forward_step_calc_loss
        assert isinstance(patched, wrapt.FunctionWrapper), type(patched)
        original = patched.__wrapped__
        store, alive = run(schedules)
        assert type(store) is list and len(store) == 2, store
        assert gradguard.find_graphs(store) == [], gradguard.find_graphs(store)
        assert alive == 0, alive
    assert schedules.forward_step_calc_loss is original, "not restored"
    assert sys.modules[NAME].forward_step_calc_loss is original
    leaked, alive = run(schedules)  # control: unguarded after exit, the leak is back
    assert len(gradguard.find_graphs(leaked)) == 4 and alive == 2, (gradguard.find_graphs(leaked), alive)
    gc.unfreeze()  # let interpreter shutdown free them (else triton's nanobind reports leaks)
    print("GRADGUARD-BEFORE-IMPORT-OK")
    """
)


@pytest.mark.integration
def test_enforce_entered_before_megatron_import(schedules: ModuleType) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    proc = subprocess.run(
        [sys.executable, "-c", BEFORE_IMPORT], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GRADGUARD-BEFORE-IMPORT-OK" in proc.stdout


# --------------------------------------------------------------------------------------------------
# 8. mode "off" inside enforce: pass-through
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_off_mode_inside_enforce_passes_through(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")  # off also skips the loss check
    with gradguard.enforce(mode="off"):
        assert isinstance(schedules.forward_step_calc_loss, wrapt.FunctionWrapper)
        run = run_forward_step(schedules, loss_2tuple_heavy, n=3)
        detached = run_forward_step(schedules, loss_detached, n=1)
    assert [p for p, _ in graph_paths(run.store)] == [
        f"[{i}]['{k}']" for i in range(3) for k in ("logits", "logits_sq")
    ]
    assert run.alive() == 3
    assert len(detached.store) == 1
    assert gradguard.stats() == {}
