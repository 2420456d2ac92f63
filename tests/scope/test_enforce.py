"""``gradguard.enforce()``: mode scope, reference-counted install of engine adapters and user stores.

Context manager and decorator; nesting; exception safety; several threads at once; unresolvable
store targets; originals restored by identity; the cost of a nested enter/exit.
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import wrapt

import gradguard
from gradguard import GradGuardError, GraphRetentionError
from gradguard._guards import patch as _patch
from gradguard._scope import enforce as _enforce


def _line_of(module: ModuleType, marker: str) -> int:
    lines = Path(module.__file__).read_text().splitlines()  # type: ignore[arg-type]
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def _nothing_installed() -> bool:
    return _enforce.installed() == {}


# --------------------------------------------------------------------------------------------------
# Mode scope
# --------------------------------------------------------------------------------------------------


def test_context_manager_sets_the_mode_inside() -> None:
    assert gradguard.get_mode() == "detach"
    with gradguard.enforce(mode="raise", engines="none") as scope:
        assert isinstance(scope, gradguard.enforce)
        assert gradguard.get_mode() == "raise"
    assert gradguard.get_mode() == "detach"
    with gradguard.enforce(mode="strict", engines="none"):  # aliases accepted
        assert gradguard.get_mode() == "raise"


def test_mode_none_keeps_the_enclosing_mode() -> None:
    gradguard.set_mode("warn")
    with gradguard.enforce(engines="none"):
        assert gradguard.get_mode() == "warn"
        with gradguard.enforce(mode="off", engines="none"):
            assert gradguard.get_mode() == "off"
            with gradguard.enforce(engines="none"):
                assert gradguard.get_mode() == "off"
        assert gradguard.get_mode() == "warn"
    assert gradguard.get_mode() == "warn"


def test_enforce_beats_set_mode() -> None:
    gradguard.set_mode("off")
    with gradguard.enforce(mode="raise", engines="none"):
        assert gradguard.get_mode() == "raise"
    assert gradguard.get_mode() == "off"


def test_bad_mode_is_an_error() -> None:
    with pytest.raises(GradGuardError, match="not a gradguard mode"):
        gradguard.enforce(mode="loud")


def test_decorator_keeps_name_and_applies_mode_inside(sched: ModuleType) -> None:
    seen: list[Any] = []

    @gradguard.enforce(mode="raise", engines="none", stores={f"{sched.__name__}:run_schedule": "store"})
    def train_step(n: int) -> list[Any]:
        """Train one step."""
        seen.append((gradguard.get_mode(), isinstance(sched.run_schedule, wrapt.FunctionWrapper)))
        return [n]

    assert train_step.__name__ == "train_step"
    assert train_step.__doc__ == "Train one step."
    assert not isinstance(sched.run_schedule, wrapt.FunctionWrapper)
    assert train_step(3) == [3]
    assert train_step(4) == [4]  # re-enterable
    assert seen == [("raise", True), ("raise", True)]
    assert gradguard.get_mode() == "detach"
    assert not isinstance(sched.run_schedule, wrapt.FunctionWrapper)


def test_decorator_exits_on_exception() -> None:
    @gradguard.enforce(mode="warn", engines="auto")
    def boom() -> None:
        assert gradguard.get_mode() == "warn"
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert gradguard.get_mode() == "detach"
    assert _nothing_installed()


def test_nested_modes_inner_rules_outer_comes_back() -> None:
    with gradguard.enforce(mode="warn", engines="none"):
        assert gradguard.get_mode() == "warn"
        with gradguard.enforce(mode="raise", engines="auto"):
            assert gradguard.get_mode() == "raise"
            with gradguard.enforce(mode="off", engines="none"):
                assert gradguard.get_mode() == "off"
            assert gradguard.get_mode() == "raise"
        assert gradguard.get_mode() == "warn"
    assert gradguard.get_mode() == "detach"


def test_same_instance_nested_and_reused() -> None:
    scope = gradguard.enforce(mode="raise", engines="auto")
    with scope:
        with scope:
            assert gradguard.get_mode() == "raise"
        assert gradguard.get_mode() == "raise"
        assert _enforce.installed()[("engine", "pipelining")] == 1
    assert gradguard.get_mode() == "detach"
    with scope:
        assert gradguard.get_mode() == "raise"


def test_exception_in_nested_block_restores_mode_and_install(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule
    with pytest.raises(ValueError, match="inner"):
        with gradguard.enforce(mode="warn", engines="auto", stores={target: "store"}):
            with gradguard.enforce(mode="raise", engines="auto", stores={target: "store"}):
                assert _enforce.installed()[("store", target)] == 2
                assert sched.run_schedule is not original
                raise ValueError("inner")
    assert gradguard.get_mode() == "detach"
    assert _nothing_installed()
    assert sched.run_schedule is original
    assert not _patch.is_installed(sched, "run_schedule")

    with gradguard.enforce(mode="warn", engines="none", stores={target: "store"}):
        with pytest.raises(ValueError):
            with gradguard.enforce(mode="raise", engines="none", stores={target: "store"}):
                raise ValueError("inner only")
        assert gradguard.get_mode() == "warn"  # the outer comes back
        assert _enforce.installed() == {("store", target): 1}
        assert sched.run_schedule is not original
    assert sched.run_schedule is original


def test_get_mode_is_context_local_across_threads() -> None:
    entered, release = threading.Event(), threading.Event()
    inside: list[str] = []

    def worker() -> None:
        with gradguard.enforce(mode="raise", engines="none"):
            inside.append(gradguard.get_mode())
            entered.set()
            release.wait(120)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(120)
        assert gradguard.get_mode() == "detach"  # the other thread's enforce does not leak here
        with gradguard.enforce(mode="off", engines="none"):
            assert gradguard.get_mode() == "off"
    finally:
        release.set()
        thread.join(10)
    assert inside == ["raise"]


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------


def test_engines_none_installs_nothing() -> None:
    with gradguard.enforce(engines="none"):
        assert _enforce.installed() == {}
    with gradguard.enforce(engines=[]):
        assert _enforce.installed() == {}


def test_engines_auto_installs_every_known_adapter() -> None:
    with gradguard.enforce():
        assert set(_enforce.installed()) == {("engine", name) for name in gradguard.engines.KNOWN}
    assert _nothing_installed()


def test_engines_list_installs_only_those_and_restores_by_identity() -> None:
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    if not hasattr(schedules._PipelineSchedule, "eval"):
        pytest.skip(
            "this torch's schedules have no eval: the adapter patches nothing (tests/scope/test_versions_engines.py)"
        )
    cls = schedules.PipelineScheduleSingle
    original = vars(cls)["step"]
    with gradguard.enforce(engines=["pipelining"]):
        assert set(_enforce.installed()) == {("engine", "pipelining")}
        assert isinstance(vars(cls)["step"], wrapt.FunctionWrapper)
        assert vars(cls)["step"].__wrapped__ is original
        with gradguard.enforce(engines="pipelining"):  # a single name as a string
            assert _enforce.installed()[("engine", "pipelining")] == 2
        assert isinstance(vars(cls)["step"], wrapt.FunctionWrapper)
    assert vars(cls)["step"] is original


@pytest.mark.parametrize("engines", ["deepspeed", ["pipelining", "vllm"]])
def test_unknown_engine_lists_the_known_ones(engines: Any) -> None:
    with pytest.raises(GradGuardError) as info:
        gradguard.enforce(engines=engines)
    msg = str(info.value)
    assert "unknown engine" in msg
    assert "megatron" in msg and "pipelining" in msg
    assert _nothing_installed()


# --------------------------------------------------------------------------------------------------
# User stores
# --------------------------------------------------------------------------------------------------


def test_store_target_guards_the_argument_inside_only(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule

    outside: list[Any] = sched.run_schedule(2, [])
    assert all(r["x"].grad_fn is not None for r in outside)  # not guarded outside

    with gradguard.enforce(engines="none", stores={target: "store"}):
        assert sched.run_schedule is not original
        store: list[Any] = []
        returned = sched.run_schedule(3, store)
        by_keyword: list[Any] = []
        sched.run_schedule(2, store=by_keyword)
        from_other_name = importlib.import_module(sched.__name__).run_schedule(1, [])

    assert sched.run_schedule is original  # restored exactly
    assert type(store) is list and len(store) == 3  # the caller's list got the records
    assert all(r["x"].grad_fn is None and not r["x"].requires_grad for r in store)
    assert [r["i"] for r in store] == [0, 1, 2]
    assert gradguard.unwrap(returned) is store
    assert len(by_keyword) == 2 and all(r["x"].grad_fn is None for r in by_keyword)
    assert from_other_name[0]["x"].grad_fn is None

    site = f"{sched.__file__}:{_line_of(sched, 'APPEND-LINE')}"
    entry = gradguard.stats()[(f"{target}:store", site)]
    assert entry.records == 6 and entry.tensors_detached == 6

    after = sched.run_schedule(1, [])
    assert after[0]["x"].grad_fn is not None  # not guarded after exit


def test_store_target_none_argument_passes(sched: ModuleType) -> None:
    with gradguard.enforce(engines="none", stores={f"{sched.__name__}:run_with_default": "store"}):
        assert sched.run_with_default(1) is None
        assert sched.run_with_default(1, None) is None
        store: list[Any] = []
        sched.run_with_default(1, store)
    assert store[0].grad_fn is None


def test_store_target_raise_mode_names_the_caller_line(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    store: list[Any] = []
    with gradguard.enforce(mode="raise", engines="none", stores={target: "store"}):
        with pytest.raises(GraphRetentionError) as info:
            sched.run_schedule(2, store)
    assert store == []  # refused: nothing stored
    msg = str(info.value)
    assert f"{sched.__file__}:{_line_of(sched, 'APPEND-LINE')}" in msg
    assert "['x']" in msg and f"{target}:store" in msg


def test_class_method_targets(sched: ModuleType) -> None:
    cls = sched.Scheduler
    originals = {name: vars(cls)[name] for name in ("run", "srun", "crun")}
    stores = {f"{sched.__name__}:Scheduler.{name}": "store" for name in originals}
    with gradguard.enforce(engines="none", stores=stores):
        instance_call = cls().run(2, [])
        class_call = cls.run(cls(), 1, [])
        keyword_call = cls().run(1, store=[])
        static_call = cls.srun(1, [])
        static_on_instance = cls().srun(1, [])
        class_method = cls.crun(1, [])
    for records in (instance_call, class_call, keyword_call):
        assert records and all(r["x"].grad_fn is None for r in gradguard.unwrap(records))
    for records in (static_call, static_on_instance, class_method):
        assert gradguard.unwrap(records)[0].grad_fn is None
    for name, original in originals.items():
        assert vars(cls)[name] is original  # staticmethod / classmethod descriptors too
    assert cls().run(1, [])[0]["x"].grad_fn is not None


def test_inherited_method_targets(sched: ModuleType) -> None:
    """``Sub.method`` where the method lives on a base class: wrapped on Sub, override removed on exit."""
    sub, base = sched.SubScheduler, sched.Scheduler
    names = ("run", "srun", "crun")
    base_dict = {name: vars(base)[name] for name in names}
    stores = {f"{sched.__name__}:SubScheduler.{name}": "store" for name in names}
    with gradguard.enforce(engines="none", stores=stores):
        run = sub().run(1, [])
        srun = sub.srun(1, [])
        crun = sub.crun(1, [])
        base_run = base().run(1, [])  # the base class is not patched
    assert gradguard.unwrap(run)[0]["x"].grad_fn is None
    assert gradguard.unwrap(srun)[0].grad_fn is None and gradguard.unwrap(crun)[0].grad_fn is None
    assert base_run[0]["x"].grad_fn is not None
    assert all(name not in vars(sub) for name in names)  # overrides removed: inherits again
    assert all(vars(base)[name] is base_dict[name] for name in names)


def test_store_target_nested_counts(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule
    with gradguard.enforce(engines="none", stores={target: "store"}):
        patched = sched.run_schedule
        with gradguard.enforce(engines="none", stores={target: "store"}):
            assert sched.run_schedule is patched  # installed once
        assert sched.run_schedule is patched  # still installed: the outer holds it
        assert sched.run_schedule(1, [])[0]["x"].grad_fn is None
    assert sched.run_schedule is original


def test_store_restored_even_if_its_module_was_reimported(sched: ModuleType) -> None:
    """Exit restores the object that was patched, not whatever the target resolves to by then."""
    original = sched.run_schedule
    with gradguard.enforce(engines="none", stores={f"{sched.__name__}:run_schedule": "store"}):
        assert sched.run_schedule is not original
        del sys.modules[sched.__name__]
        importlib.import_module(sched.__name__)  # a new module object under the same name
    assert sched.run_schedule is original
    assert not _patch.is_installed(sched, "run_schedule")


def test_same_target_with_another_argument_is_an_error_not_a_no_op(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule
    with gradguard.enforce(engines="none", stores={target: "store"}):
        patched = sched.run_schedule
        with pytest.raises(GradGuardError, match="already patched"):
            with gradguard.enforce(engines="none", stores={target: "n"}):
                pytest.fail("entered")
        assert sched.run_schedule is patched  # the enclosing guard is intact
        assert _enforce.installed() == {("store", target): 1}
        assert sched.run_schedule(1, [])[0]["x"].grad_fn is None
    assert sched.run_schedule is original


@pytest.mark.parametrize(
    ("make_target", "arg", "match"),
    [
        (lambda m: "gg_no_such_module_xyz:run", "store", "cannot import 'gg_no_such_module_xyz'"),
        (lambda m: f"{m}:no_such_function", "store", "no_such_function"),
        (lambda m: f"{m}:Scheduler.no_such_method", "store", "no_such_method"),
        (lambda m: f"{m}:NoSuchClass.run", "store", "NoSuchClass"),
        (lambda m: f"{m}:run_schedule", "no_such_arg", r"no parameter 'no_such_arg'"),
        (lambda m: f"{m}:NOT_CALLABLE", "store", "not a function"),
    ],
    ids=["module", "function", "method", "class", "argument", "not-callable"],
)
def test_unresolvable_store_target_is_an_error_on_entering(
    sched: ModuleType, make_target: Any, arg: str, match: str
) -> None:
    target = make_target(sched.__name__)
    scope = gradguard.enforce(engines="none", stores={target: arg})
    with pytest.raises(GradGuardError, match=match) as info:
        with scope:
            pytest.fail("entered")
    assert target in str(info.value)
    assert _nothing_installed()
    assert gradguard.get_mode() == "detach"


@pytest.mark.parametrize(
    "stores",
    [{"no_colon_here": "store"}, {"a:b:c": "store"}, {":func": "store"}, {"mod:": "store"}, {"mod:f": ""}, ["mod:f"]],
    ids=["no-colon", "two-colons", "no-module", "no-function", "no-argument", "not-a-mapping"],
)
def test_malformed_store_targets_are_errors(stores: Any) -> None:
    said = r"^stores.* is not accepted; accepted: (.*'pkg.module:function'|the name)"
    with pytest.raises(GradGuardError, match=said):
        with gradguard.enforce(engines="none", stores=stores):
            pytest.fail("entered")
    assert _nothing_installed()


def test_failed_enter_rolls_back_everything_it_installed(sched: ModuleType) -> None:
    good = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    step = vars(schedules.PipelineScheduleSingle)["step"]
    bad_scope = gradguard.enforce(engines="auto", stores={good: "store", f"{sched.__name__}:missing": "store"})
    with pytest.raises(GradGuardError, match="missing"):
        with bad_scope:
            pytest.fail("entered")
    assert _nothing_installed()
    assert sched.run_schedule is original
    assert vars(schedules.PipelineScheduleSingle)["step"] is step
    assert gradguard.get_mode() == "detach"

    # Inside an outer scope the failure takes back only its own references.
    with gradguard.enforce(mode="warn", engines="auto", stores={good: "store"}):
        with pytest.raises(GradGuardError):
            with bad_scope:
                pytest.fail("entered")
        assert gradguard.get_mode() == "warn"
        assert _enforce.installed() == {
            **{("engine", name): 1 for name in gradguard.engines.KNOWN},
            ("store", good): 1,
        }
        assert sched.run_schedule is not original
    assert sched.run_schedule is original


# --------------------------------------------------------------------------------------------------
# Threads and cost
# --------------------------------------------------------------------------------------------------


def test_many_threads_entering_and_leaving_at_once(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule
    schedules = importlib.import_module("torch.distributed.pipelining.schedules")
    step = vars(schedules.PipelineScheduleSingle)["step"]
    n_threads, n_enters = 8, 200
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    modes = ["off", "detach", "warn", "raise"]

    def worker(k: int) -> None:
        try:
            mode = modes[k % len(modes)]
            barrier.wait(120)
            for i in range(n_enters):
                with gradguard.enforce(mode=mode, engines="auto", stores={target: "store"}):
                    assert gradguard.get_mode() == mode
                    if i % 50 == 0 and mode != "warn":  # warnings filters are process-global: not here
                        if mode == "raise":
                            with pytest.raises(GraphRetentionError):
                                sched.run_schedule(1, [])
                        else:
                            record = gradguard.unwrap(sched.run_schedule(1, []))[0]
                            assert (record["x"].grad_fn is not None) == (mode == "off")
                assert gradguard.get_mode() == "detach"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert _nothing_installed()
    assert sched.run_schedule is original
    assert vars(schedules.PipelineScheduleSingle)["step"] is step


def test_nested_enter_exit_reuses_the_installs(sched: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once installed, a nested scope only counts references: nothing is patched or restored again."""
    target = f"{sched.__name__}:run_schedule"
    with gradguard.enforce(engines="auto", stores={target: "store"}):
        patched = sched.run_schedule
        calls: list[str] = []
        for cls in (_enforce._StoreInstall, _enforce._EngineInstall):
            monkeypatch.setattr(cls, "install", lambda self, cls=cls: calls.append(f"install {cls.__name__}"))
            monkeypatch.setattr(cls, "uninstall", lambda self, cls=cls: calls.append(f"uninstall {cls.__name__}"))
        inner = gradguard.enforce(mode="raise", engines="auto", stores={target: "store"})
        for _ in range(3):
            with inner:
                assert sched.run_schedule is patched
        assert calls == []
        monkeypatch.undo()
    assert not _patch.is_installed(sched, "run_schedule")


def test_construction_and_installed_state_are_separate() -> None:
    scope = gradguard.enforce(mode="raise", engines="auto")
    assert _nothing_installed()  # constructing installs nothing
    assert "raise" in repr(scope) and "pipelining" in repr(scope)
    assert gradguard.get_mode() == "detach"


def test_tensors_under_enforce_are_untouched_outside_stores() -> None:
    leaf = torch.ones(2, requires_grad=True)
    with gradguard.enforce(mode="raise", engines="none"):
        y = leaf * 2
    assert y.grad_fn is not None  # enforce guards stores, not ordinary code


# --------------------------------------------------------------------------------------------------
# Arguments, imports bound before the scope, generators and coroutines, bad engines
# --------------------------------------------------------------------------------------------------

VARARGS_SOURCE = """
import torch
X = torch.ones(2, requires_grad=True)

def run(*batches, output_lst=None):
    if output_lst is not None:
        output_lst.append(X * 2)
    return len(batches)

def step(output_lst):
    output_lst.append(X * 3)

class Engine:
    def step(self, output_lst):
        output_lst.append(X * 4)

engine = Engine()
"""


@pytest.fixture
def varargs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    name = f"gg_varargs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(VARARGS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def test_a_keyword_only_store_after_varargs_is_only_taken_by_keyword(varargs: ModuleType) -> None:
    """A store parameter after *args must not take a positional argument (a valid call then failed)."""
    x = torch.randn(2)
    with gradguard.enforce(engines="none", stores={f"{varargs.__name__}:run": "output_lst"}):
        assert varargs.run(x, x) == 2  # the positional batches are left alone
        out: list[Any] = []
        assert varargs.run(x, output_lst=out) == 1
        assert len(out) == 1 and out[0].grad_fn is None


def test_a_name_imported_before_the_scope_is_guarded_too(varargs: ModuleType) -> None:
    """`from module import step` before the scope binds the unpatched function: it must not be silently unguarded."""
    namespace: dict[str, Any] = {}
    exec(f"from {varargs.__name__} import step", namespace)  # noqa: S102 - a module importing the name
    alias = types_module("gg_alias_" + uuid.uuid4().hex[:8], namespace)
    original = varargs.step
    try:
        with gradguard.enforce(mode="raise", engines="none", stores={f"{varargs.__name__}:step": "output_lst"}):
            with pytest.raises(GraphRetentionError):
                alias.step([])
            assert alias.step is not original
        assert alias.step is original and varargs.step is original
    finally:
        sys.modules.pop(alias.__name__, None)


def types_module(name: str, namespace: dict[str, Any]) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(namespace)
    sys.modules[name] = module
    return module


def test_a_bound_method_target_is_restored_exactly(varargs: ModuleType) -> None:
    """The instance must not be left with a bound method in its __dict__ after the scope."""
    assert "step" not in vars(varargs.engine)
    with gradguard.enforce(mode="raise", engines="none", stores={f"{varargs.__name__}:engine.step": "output_lst"}):
        with pytest.raises(GraphRetentionError):
            varargs.engine.step([])
        out: list[Any] = []
        varargs.Engine().step(out)  # another instance: not a target
        assert out[0].grad_fn is not None
    assert "step" not in vars(varargs.engine)


def test_enforce_scopes_the_body_of_generator_and_async_functions() -> None:
    """The body of a decorated generator or coroutine runs inside the scope."""
    import asyncio
    import inspect

    x = torch.randn(2, requires_grad=True)
    seen: list[str] = []

    @gradguard.enforce(mode="raise", engines="none")
    def steps(store: Any) -> Iterator[int]:
        for i in range(2):
            seen.append(gradguard.get_mode())
            yield i
        store.append({"y": x * 2})

    @gradguard.enforce(mode="raise", engines="none")
    async def step(store: Any) -> None:
        await asyncio.sleep(0)
        seen.append(gradguard.get_mode())
        store.append({"y": x * 2})

    @gradguard.enforce(mode="warn", engines="none")
    async def agen() -> Any:
        for i in range(2):
            seen.append(gradguard.get_mode())
            yield i

    assert inspect.isgeneratorfunction(steps) and inspect.iscoroutinefunction(step)
    gen = steps(gradguard.guard([]))
    assert next(gen) == 0
    assert gradguard.get_mode() == "detach"  # between resumptions, the caller's own mode
    assert next(gen) == 1
    with pytest.raises(GraphRetentionError):
        next(gen)
    with pytest.raises(GraphRetentionError):
        asyncio.run(step(gradguard.guard([])))

    async def collect() -> list[int]:
        return [i async for i in agen()]

    assert asyncio.run(collect()) == [0, 1]
    assert seen == ["raise", "raise", "raise", "warn", "warn"]
    assert _nothing_installed()


def test_a_generator_scope_holds_its_installs_until_it_ends(sched: ModuleType) -> None:
    target = f"{sched.__name__}:run_schedule"
    original = sched.run_schedule

    @gradguard.enforce(engines="none", stores={target: "store"})
    def steps() -> Iterator[int]:
        yield 1
        yield 2

    gen = steps()
    assert sched.run_schedule is original  # nothing installed until the body starts
    next(gen)
    assert sched.run_schedule is not original
    gen.close()
    assert sched.run_schedule is original
    assert list(steps()) == [1, 2] and sched.run_schedule is original  # run to its end
    abandoned = steps()
    next(abandoned)
    assert sched.run_schedule is not original
    del abandoned  # collected unfinished: the installs are given back
    gc.collect()
    assert sched.run_schedule is original


@pytest.mark.parametrize("bad", [123, b"megatron", 1.5, object()])
def test_engines_that_are_not_names_are_clear_errors(bad: Any) -> None:
    """enforce(engines=123) and engines=b"megatron" are refused naming the value (not 'unknown engine 109')."""
    with pytest.raises(GradGuardError, match=r"engines=.* is not accepted; accepted: 'auto', 'none', or a list"):
        gradguard.enforce(engines=bad)
