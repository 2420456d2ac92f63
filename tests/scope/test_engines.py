"""The adapter contract: metadata shown by doctor, and an adapter refusing a signature it cannot read."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import wrapt

import gradguard
from gradguard import engines
from gradguard.engines import megatron

SCHEDULES = megatron.ADAPTER.modules[0]


def _moved_schedules() -> types.ModuleType:
    """A schedules module whose forward_step_calc_loss no longer takes forward_data_store."""
    module = types.ModuleType(SCHEDULES)
    exec("def forward_step_calc_loss(model, output_tensor, loss_func, config):\n    pass", module.__dict__)  # noqa: S102
    return module


@pytest.mark.parametrize("name", engines.KNOWN)
def test_every_adapter_states_what_it_waits_for_and_supports(name: str) -> None:
    adapter = engines.load(name)
    assert isinstance(adapter, engines.Adapter) and adapter.name == name
    assert adapter.modules and all(isinstance(m, str) for m in adapter.modules)
    assert adapter.package and adapter.supported
    assert adapter.supports("0.0.1") is False
    assert adapter.supports("not a version") is None


def test_a_moved_signature_is_refused_naming_the_parameter() -> None:
    with pytest.raises(gradguard.GradGuardError) as info:
        megatron.ADAPTER.instrument(_moved_schedules())
    message = str(info.value)
    assert "has no parameter 'forward_data_store'" in message
    assert "outside the supported range '>=0.12,<0.20'" in message


def test_entering_with_an_unreadable_engine_fails_and_installs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, SCHEDULES, _moved_schedules())
    with pytest.raises(gradguard.GradGuardError, match="forward_data_store"):
        with gradguard.enforce(engines=["megatron"]):
            pytest.fail("entered")


def test_an_engine_imported_later_with_an_unreadable_signature_warns_and_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, SCHEDULES, raising=False)
    with gradguard.enforce(engines=["megatron"]):
        module = _moved_schedules()
        monkeypatch.setitem(sys.modules, SCHEDULES, module)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapt.notify_module_loaded(module)  # what wrapt's import hook does once the module is imported
    assert any(
        issubclass(w.category, gradguard.GradGuardWarning) and "adapter was not installed" in str(w.message)
        for w in caught
    )
    assert not isinstance(module.forward_step_calc_loss, wrapt.FunctionWrapper)


def test_an_engine_module_imported_again_is_instrumented_again_and_both_are_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """wrapt's post-import hooks fire once: a module that left sys.modules and is imported again under a
    later scope still gets one, and each module object patched is the one restored."""

    def schedules() -> types.ModuleType:
        module = types.ModuleType(SCHEDULES)
        exec(  # noqa: S102 - a stand-in with the signature megatron-core 0.19 has
            "def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,"
            " num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None):\n    pass",
            module.__dict__,
        )
        return module

    monkeypatch.delitem(sys.modules, SCHEDULES, raising=False)
    first, second = schedules(), schedules()
    originals = first.forward_step_calc_loss, second.forward_step_calc_loss
    for module in (first, second):
        with gradguard.enforce(engines=["megatron"]):
            monkeypatch.setitem(sys.modules, SCHEDULES, module)
            wrapt.notify_module_loaded(module)  # an import, as wrapt's finder reports it
            assert isinstance(module.forward_step_calc_loss, wrapt.FunctionWrapper)
            monkeypatch.delitem(sys.modules, SCHEDULES)  # gone from sys.modules while patched
        assert module.forward_step_calc_loss is originals[(module is second)]  # restored all the same
