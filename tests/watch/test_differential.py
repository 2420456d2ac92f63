"""The differential test of the step-boundary watch: a corpus of training programs, each run without the
watch and inside ``gradguard.watch(every=1, mode=M)``.

``corpus/correct/`` holds correct programs (the shapes that gave false alarms or changed training:
accumulation, AMP, LBFGS, GANs, a WGAN critic loop, actor-critic, EMA, compile, checkpointing,
retain_graph, gradient penalty, RL, threads, generators, asyncio, inner adaptation, tied weights,
module-level scripts, HF Trainer, Lightning). Each is run twice unwatched (it must be deterministic)
and once in each of ``off``, ``detach``, ``warn`` and ``raise``: it is never reported (no error, no
gradguard warning, an empty ``watcher.history()``), the watch did audit its boundaries, and its final
weights are bitwise identical to the unwatched run's.

``corpus/leaks/`` holds programs that keep autograd graphs across step boundaries, in the shapes
found in the field. Each declares, as module globals:

* ``EXPECT_HOLDER``: a substring of the holder the report must name (the container a user would fix);
  exactly one report entry (one row per holder container) contains it;
* ``EXPECT_OUTCOME_DETACH``: what ``detach`` mode does with it (``HolderHistory.outcome``):
  ``repaired`` (a dead graph in user state), ``not repairable`` (dead, but held where gradguard may
  not write) or ``live`` (still usable for backward: reported, never repaired); the last two warn;
* ``PINNED_PER_STEP`` (optional): the bytes the leak pins per step, checked against the unwatched
  run's memory growth (within 10%) and, once repaired, against a flat memory (under 10% of it);
* ``ALSO_REPORTED`` (optional): substrings of other holders the report may name as well.

A leak program is run unwatched twice (deterministic; its memory measured), in ``raise`` (a
``GraphRetentionError`` naming the holder) and in ``detach`` (the outcome, the memory, and final
weights equal to the unwatched run's: a dead graph cannot change a gradient, a live one is never
repaired).

Every program sets its own seeds, runs in-process through ``runpy.run_path(path, run_name="__main__")``
(its top-level variables are ``__main__`` globals, as in a real script) and stores its final parameters
in the global ``RESULT``. Programs needing an engine (or inductor's C++ compiler) declare ``REQUIRES``,
are marked ``integration`` and run last. Every audit sees the whole process: the holders of graphs other
tests left are ignored, and after a program its globals are cleared and nothing it made may still hold
a graph. Each audit searches the whole heap, so the programs are tiny and take few steps.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gc
import pathlib
import runpy
import sys
import traceback
import types
import warnings
from typing import Any

import pytest
import torch
from _helpers import require_engine
from torch.optim.optimizer import register_optimizer_step_post_hook

import gradguard
from gradguard.testing import MemoryProbe

CORPUS = pathlib.Path(__file__).parent / "corpus"
MODES = ("off", "detach", "warn", "raise")
OUTCOMES = {"repaired", "repaired in part", "not repairable", "live"}
FLAT = 0.10  # after a repair, memory may grow by at most this share of PINNED_PER_STEP per step


# --------------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    path: pathlib.Path
    requires: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.stem


def _literals(path: pathlib.Path) -> dict[str, Any]:
    """The program's top-level ``NAME = <literal>`` assignments, read without running it."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found


def _requires(path: pathlib.Path) -> tuple[str, ...]:
    return tuple(_literals(path).get("REQUIRES", ()))


def _corpus(kind: str, *, engines: bool) -> list[Any]:
    """The programs of ``corpus/<kind>/``: those with ``REQUIRES`` (``engines=True``, marked ``integration``)
    or the others. The engine programs' tests come last in this file: importing an engine grows the heap,
    and every audit's time with it."""
    params = []
    for path in sorted((CORPUS / kind).glob("*.py")):
        program = Program(path, _requires(path))
        if bool(program.requires) == engines:
            marks = [pytest.mark.integration] if engines else []
            params.append(pytest.param(program, id=program.name, marks=marks))
    return params


CORRECT = _corpus("correct", engines=False)
LEAKS = _corpus("leaks", engines=False)
ENGINE_CORRECT = _corpus("correct", engines=True)


# --------------------------------------------------------------------------------------------------
# Running a program
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What one run of a program left: no object of the program, only copies, strings and numbers."""

    result: dict[str, torch.Tensor] | None
    constants: dict[str, Any]
    error: str | None  # "Type: message" of an exception out of the program
    report: list[gradguard.Retention] | None  # a GraphRetentionError's report
    warnings: list[str]  # gradguard's warnings (GradGuardWarning and its subclasses), "Category: message"
    history: list[Any]  # HolderHistory records
    audits: int
    boundaries: int
    audit_seconds: float  # the watch's own time in its audits
    readings: list[int]  # live bytes after each optimizer step (MemoryProbe), when measured
    leftover: list[str]  # holders of graphs still alive after the program's globals were cleared

    def holders(self) -> list[str]:
        return [r.holder for r in self.report or []]


def _constants(namespace: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in namespace.items()
        if k.isupper() and isinstance(v, (str, int, float, tuple)) and not k.startswith("_")
    }


def _program_globals(namespace: dict[str, Any], path: pathlib.Path) -> list[dict[str, Any]]:
    """The program's own globals dicts, reached through the functions and methods it defined (runpy
    returns a copy; the original lives on in a cycle with those functions)."""
    found: dict[int, dict[str, Any]] = {}
    for value in list(namespace.values()):
        members = list(vars(value).values()) if isinstance(value, type) else [value]
        for member in members:
            function = getattr(member, "__func__", member)  # classmethod, staticmethod
            if isinstance(function, types.FunctionType) and function.__globals__.get("__file__") == str(path):
                found[id(function.__globals__)] = function.__globals__
    return list(found.values())


def _forget(exc: BaseException) -> None:
    """Drop the frames an exception's traceback (and its chain) keeps: they hold the program's graphs."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__context__ or exc.__cause__  # type: ignore[assignment]


_elsewhere: set[str] = set()
"""Holders of graphs alive before this file's runs (left by other tests): every watch here ignores them."""


@pytest.fixture(autouse=True)
def _graphs_left_elsewhere(request: pytest.FixtureRequest) -> None:
    """Audit what other tests left whenever the previous test was not one of this file's (each run here
    ends clean, so one audit serves all the tests that follow it)."""
    items = request.session.items
    index = items.index(request.node) if request.node in items else 0
    if index == 0 or getattr(items[index - 1], "module", None) is not request.node.module:
        gc.collect()
        _elsewhere.clear()
        _elsewhere.update(r.holder for r in gradguard.audit())


def _ignored(entry: gradguard.Retention) -> bool:
    return entry.holder in _elsewhere


def execute(program: Program, mode: str | None, *, measure: bool = False, check_leftover: bool = False) -> Run:
    """Run ``program`` once: without the watch (``mode=None``) or inside ``gradguard.watch(every=1, mode)``;
    with ``measure``, take a MemoryProbe reading after every optimizer step (after the watch acted); with
    ``check_leftover``, collect garbage and list the holders of graphs still held once its globals are
    cleared (``Run.leftover``). The collection matters beyond the check: graph tensors left in garbage
    (an exception's cycles after ``raise``, a class's attributes) make every later audit search for
    their holders, several times slower with threads."""
    for module in program.requires:
        require_engine(module)
    scope = gradguard.watch(every=1, mode=mode, ignore=_ignored) if mode is not None else None
    probe = MemoryProbe() if measure else None
    error: BaseException | None = None
    returned: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        if scope is not None:
            stack.enter_context(scope)
        if probe is not None:
            stack.enter_context(probe)
            stack.callback(register_optimizer_step_post_hook(lambda *_: probe.step()).remove)
        try:
            returned = runpy.run_path(str(program.path), run_name="__main__")
        except Exception as exc:  # noqa: BLE001 - reported by the tests
            error = exc
    result = returned.get("RESULT")
    if isinstance(result, dict):
        result = {k: v.detach().clone() for k, v in result.items()}
    constants = _constants(returned)
    for namespace in _program_globals(returned, program.path):
        namespace.clear()  # breaks the cycle: what the program kept is freed now, not at the next collection
    returned.clear()
    report = None
    message = None
    if error is not None:
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, gradguard.GraphRetentionError):
            report = list(error.report)  # type: ignore[attr-defined]
        _forget(error)  # its frames hold the program's globals and graphs
        error = None
    retention_warnings = [
        f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, gradguard.GradGuardWarning)
    ]
    caught.clear()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # compiled code and its guards refer to the program's objects
    leftover: list[str] = []
    if check_leftover:
        gc.collect()
        leftover = sorted({r.holder for r in gradguard.audit(ignore=_ignored)})
        _elsewhere.update(leftover)  # reported by this test; the ones after it must not see them
    watcher = scope.watcher if scope is not None else None
    return Run(
        result=result,
        constants=constants,
        error=message,
        report=report,
        warnings=retention_warnings,
        history=watcher.history() if watcher else [],
        audits=watcher.audits if watcher else 0,
        boundaries=watcher.boundaries if watcher else 0,
        audit_seconds=watcher.audit_seconds if watcher else 0.0,
        readings=list(probe.readings) if probe else [],
        leftover=leftover,
    )


_references: dict[pathlib.Path, Run] = {}


def reference(program: Program) -> Run:
    """The unwatched run of ``program`` (once per session); it must finish and store RESULT."""
    run = _references.get(program.path)
    if run is None:
        run = execute(program, None, measure="PINNED_PER_STEP" in program.path.read_text(), check_leftover=True)
        assert run.error is None, f"{program.name} fails without the watch: {run.error}"
        assert run.result, f"{program.name} stores no RESULT"
        assert run.leftover == [], f"{program.name} leaves graphs alive after its globals are cleared: {run.leftover}"
        _references[program.path] = run
    return run


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def assert_same_weights(expected: dict[str, torch.Tensor] | None, got: dict[str, torch.Tensor] | None) -> None:
    assert expected is not None and got is not None, "no RESULT"
    assert got.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    if differ:
        worst = max(
            ((expected[k].double() - got[k].double()).abs().max().item(), k)
            for k in differ
            if expected[k].shape == got[k].shape
        )
        pytest.fail(
            f"final weights differ from the unwatched run: {differ} (largest |diff| {worst[0]:.3g} in {worst[1]})"
        )


def growth(readings: list[int], skip: int) -> float:
    """Bytes per step after the first ``skip`` steps, from the envelope of the readings: the larger of the
    two readings at each end. A holder the watch repairs every other boundary (a graph that is new at one
    boundary and a leak at the next) makes the readings oscillate with period two: flat, not growing."""
    tail = readings[1 + skip :]  # readings[0] is taken on entering the probe
    assert len(tail) >= 3, f"too few readings to measure growth: {readings}"
    return (max(tail[-2:]) - max(tail[:2])) / (len(tail) - 2)


def _describe(run: Run) -> str:
    rows = [f"{h.holder}: {h.outcome} (survived {h.survived}, {h.tensors} tensors)" for h in run.history]
    return f"error={run.error!r} history={rows} warnings={run.warnings}"


# --------------------------------------------------------------------------------------------------
# The corpus itself (cheap: read, not run)
# --------------------------------------------------------------------------------------------------


def test_corpus_has_the_programs_it_promises() -> None:
    correct = sorted((CORPUS / "correct").glob("*.py"))
    leaks = sorted((CORPUS / "leaks").glob("*.py"))
    assert len(correct) >= 22 and len(leaks) >= 22, (len(correct), len(leaks))
    for path in correct:
        declared = _literals(path)
        assert not any(name.startswith("EXPECT_") for name in declared), f"{path.name} is a correct program"
    for path in leaks:
        declared = _literals(path)
        assert isinstance(declared.get("EXPECT_HOLDER"), str), f"{path.name}: no literal EXPECT_HOLDER"
        assert declared.get("EXPECT_OUTCOME_DETACH") in OUTCOMES, f"{path.name}: bad EXPECT_OUTCOME_DETACH"
    for path in correct + leaks:
        text = path.read_text()
        assert "torch.set_num_threads(1)" in text and "RESULT" in text, f"{path.name}: threads or RESULT"
        assert "manual_seed" in text, f"{path.name} sets no seed"


# --------------------------------------------------------------------------------------------------
# Correct programs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("program", CORRECT)
def test_correct_program_is_deterministic(program: Program) -> None:
    _deterministic(program)


def _deterministic(program: Program) -> None:
    first = reference(program)
    second = execute(program, None)
    assert second.error is None, second.error
    assert_same_weights(first.result, second.result)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", CORRECT)
def test_correct_program_is_never_reported_nor_changed(program: Program, mode: str) -> None:
    _left_alone(program, mode)


def _left_alone(program: Program, mode: str) -> None:
    expected = reference(program)
    run = execute(program, mode, check_leftover=mode == "raise")
    assert run.error is None, f"{mode}: {run.error}"
    assert run.warnings == [], f"{mode}: gradguard warned on a correct program: {run.warnings}"
    assert run.history == [], f"{mode}: a correct program was reported: {_describe(run)}"
    assert_same_weights(expected.result, run.result)
    assert run.leftover == [], f"graphs alive after the run: {run.leftover}"
    assert run.boundaries > 0, "the watch saw no optimizer step"
    if mode == "off":
        assert run.audits == 0
    else:
        assert run.audits > 0, "the watch audited no boundary: the comparison proves nothing"


# --------------------------------------------------------------------------------------------------
# Leaks
# --------------------------------------------------------------------------------------------------


def _expectations(program: Program) -> tuple[str, str, int | None, tuple[str, ...]]:
    constants = reference(program).constants
    holder, outcome = constants.get("EXPECT_HOLDER"), constants.get("EXPECT_OUTCOME_DETACH")
    assert isinstance(holder, str) and holder, f"{program.name} declares no EXPECT_HOLDER"
    assert outcome in OUTCOMES, f"{program.name}: EXPECT_OUTCOME_DETACH={outcome!r} is not one of {OUTCOMES}"
    return holder, outcome, constants.get("PINNED_PER_STEP"), tuple(constants.get("ALSO_REPORTED", ()))


def _entry(run: Run, holder: str, mode: str) -> Any:
    matching = [h for h in run.history if holder in h.holder]
    assert len(matching) == 1, f"{mode}: expected one holder containing {holder!r}; got {_describe(run)}"
    return matching[0]


def _only_expected(holders: list[str], holder: str, also: tuple[str, ...]) -> list[str]:
    return [h for h in holders if holder not in h and not any(a in h for a in also)]


@pytest.mark.parametrize("program", LEAKS)
def test_leak_is_deterministic_and_pins_what_it_declares(program: Program) -> None:
    first = reference(program)
    _, _, pinned, _ = _expectations(program)
    second = execute(program, None)
    assert second.error is None, second.error
    assert_same_weights(first.result, second.result)
    if pinned is not None:
        measured = growth(first.readings, skip=1)
        assert abs(measured - pinned) <= FLAT * pinned, (
            f"unwatched growth {measured:,.0f} B/step, declared PINNED_PER_STEP {pinned:,} B; readings {first.readings}"
        )


@pytest.mark.parametrize("program", LEAKS)
def test_leak_raises_naming_its_holder(program: Program) -> None:
    holder, _, _, also = _expectations(program)
    run = execute(program, "raise", check_leftover=True)
    assert run.report is not None, f"no GraphRetentionError: {_describe(run)}"
    matching = [h for h in run.holders() if holder in h]
    assert len(matching) == 1, f"expected one report entry naming {holder!r}, got {run.holders()}"
    assert _only_expected(run.holders(), holder, also) == [], f"unexpected holders: {run.holders()}"
    assert run.leftover == [], f"graphs alive after the run: {run.leftover}"


@pytest.mark.parametrize("program", LEAKS)
def test_leak_detach_outcome_weights_and_memory(program: Program) -> None:
    holder, outcome, pinned, also = _expectations(program)
    run = execute(program, "detach", measure=pinned is not None)
    assert run.error is None, run.error
    entry = _entry(run, holder, "detach")
    assert entry.outcome == outcome, f"outcome {entry.outcome!r}, expected {outcome!r}: {_describe(run)}"
    assert _only_expected([h.holder for h in run.history], holder, also) == [], _describe(run)
    if outcome == "repaired":
        assert entry.repaired > 0, f"'repaired' with no tensor detached: {_describe(run)}"
    else:  # reported, as warn would: with the path, and why it was not repaired
        assert any(w.startswith("GraphRetentionWarning") for w in run.warnings), _describe(run)
    assert_same_weights(reference(program).result, run.result)
    if pinned is not None and outcome == "repaired":
        half = (len(run.readings) - 1) // 2  # the leak is found and repaired within the first half
        measured = growth(run.readings, skip=half)
        assert measured < FLAT * pinned, (
            f"memory still grows {measured:,.0f} B/step after the repair (limit {FLAT * pinned:,.0f}); "
            f"readings {run.readings}"
        )
    assert run.leftover == [], f"graphs alive after the run: {run.leftover}"


# --------------------------------------------------------------------------------------------------
# Correct programs on an engine (integration; last, see _corpus)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("program", ENGINE_CORRECT)
def test_engine_program_is_deterministic(program: Program) -> None:
    _deterministic(program)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", ENGINE_CORRECT)
def test_engine_program_is_never_reported_nor_changed(program: Program, mode: str) -> None:
    _left_alone(program, mode)
