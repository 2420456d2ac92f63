"""``@gradguard.forward_step``: the loss stays live and checked, everything else goes through the mode.

verl style ``(loss, output)`` results and Megatron style ``(output_tensor, loss_func)`` results, on
functions and methods, bare and with options; ``GRADGUARD=off`` at decoration time (in a fresh
interpreter).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import wrapt
from _models import MODEL, megatron_forward_step, outputs, verl_result

import gradguard
from gradguard import (
    GradGuardError,
    GraphRetentionError,
    GraphRetentionWarning,
    LossContractError,
)
from gradguard._guards import contract as _contract
from gradguard._policy import modes as _policy

# --------------------------------------------------------------------------------------------------
# Decoration forms
# --------------------------------------------------------------------------------------------------


def verl_forward_step(micro_batch: Any, loss_function: Any, forward_only: bool = False) -> Any:
    """Run one micro-batch."""
    return micro_batch()


def test_bare_and_with_options_keep_name_doc_and_signature() -> None:
    bare = gradguard.forward_step(verl_forward_step)
    optioned = gradguard.forward_step(loss=0, check="requires_grad", check_every=2)(verl_forward_step)
    for decorated in (bare, optioned):
        assert decorated.__name__ == "verl_forward_step"
        assert decorated.__qualname__ == "verl_forward_step"
        assert decorated.__doc__ == "Run one micro-batch."
        assert decorated.__module__ == __name__
        assert inspect.signature(decorated) == inspect.signature(verl_forward_step)
        assert decorated.__wrapped__ is verl_forward_step


def test_decorator_syntax_bare_and_called() -> None:
    @gradguard.forward_step
    def a(micro_batch: Any) -> Any:
        return micro_batch()

    @gradguard.forward_step()
    def b(micro_batch: Any) -> Any:
        return micro_batch()

    for fs in (a, b):
        loss, out = fs(verl_result)
        assert loss.grad_fn is not None
        assert out["model_output"]["log_probs"].grad_fn is None


class Engine:
    """A verl-style engine."""

    def __init__(self, detach_loss: bool = False) -> None:
        self.detach_loss = detach_loss
        self.calls = 0

    @gradguard.forward_step
    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        """One micro-batch of the engine."""
        self.calls += 1
        return verl_result(detach_loss=self.detach_loss)


def test_method_keeps_name_doc_signature() -> None:
    def original(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any: ...

    assert Engine.forward_step.__name__ == "forward_step"
    assert Engine.forward_step.__qualname__ == "Engine.forward_step"
    assert Engine.forward_step.__doc__ == "One micro-batch of the engine."
    assert list(inspect.signature(Engine.forward_step).parameters) == list(inspect.signature(original).parameters)
    bound = Engine().forward_step
    assert list(inspect.signature(bound).parameters) == ["micro_batch", "loss_function", "forward_only"]


def test_method_publishes_and_checks() -> None:
    engine = Engine()
    loss, out = engine.forward_step(None, None, False)
    assert engine.calls == 1
    assert loss.grad_fn is not None
    assert out["model_output"]["log_probs"].grad_fn is None

    bad = Engine(detach_loss=True)
    with pytest.raises(LossContractError):
        bad.forward_step(None, None, False)
    with pytest.raises(LossContractError):
        bad.forward_step(None, None, forward_only=False)
    with pytest.raises(LossContractError):
        Engine.forward_step(bad, None, None, False)  # called through the class


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.forward_step(None, None, True),
        lambda e: e.forward_step(None, None, forward_only=True),
        lambda e: e.forward_step(micro_batch=None, loss_function=None, forward_only=True),
        lambda e: Engine.forward_step(e, None, None, True),
        lambda e: Engine.forward_step(e, None, None, forward_only=True),
    ],
    ids=["positional", "keyword", "all-keywords", "class-positional", "class-keyword"],
)
def test_method_forward_only_is_not_checked_but_still_published(call: Any) -> None:
    loss, out = call(Engine(detach_loss=True))
    assert not loss.requires_grad
    assert out["model_output"]["log_probs"].grad_fn is None


# --------------------------------------------------------------------------------------------------
# Check options
# --------------------------------------------------------------------------------------------------


def test_reaches_params_catches_the_silent_zero_gradient_trap() -> None:
    @gradguard.forward_step(check="reaches_params", params=MODEL)
    def fs(micro_batch: Any, forward_only: bool = False) -> Any:
        return verl_result(detach_policy=True)

    @gradguard.forward_step
    def plain(micro_batch: Any, forward_only: bool = False) -> Any:
        return verl_result(detach_policy=True)

    loss, _ = plain(None)  # requires_grad misses it
    assert loss.requires_grad
    with pytest.raises(LossContractError, match=r"policy\.weight"):
        fs(None)
    fs(None, forward_only=True)  # forward-only: not checked

    @gradguard.forward_step(check="reaches_params", params=MODEL)
    def healthy(micro_batch: Any) -> Any:
        return verl_result()

    assert healthy(None)[0].grad_fn is not None


def test_check_every_samples_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[int] = []
    calls = {"n": 0}
    original = _contract.unreached_params

    def spy(loss: torch.Tensor, params: Any) -> list[str]:
        walks.append(calls["n"])
        return original(loss, params)

    monkeypatch.setattr(_contract, "unreached_params", spy)

    @gradguard.forward_step(check="reaches_params", params=MODEL, check_every=3)
    def fs(micro_batch: Any, detach: bool = False) -> Any:
        return verl_result(detach_loss=detach)

    for i in range(8):
        calls["n"] = i
        fs(None)
    assert walks == [0, 3, 6]
    # The calls between walks still check requires_grad.
    calls["n"] = 8
    with pytest.raises(LossContractError, match="does not require grad"):
        fs(None, detach=True)
    assert walks == [0, 3, 6]


def test_check_none_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gradguard._guards.contract, "check_loss", lambda *a, **k: pytest.fail("checked"))

    @gradguard.forward_step(check=None)
    def fs(micro_batch: Any) -> Any:
        return verl_result(detach_loss=True)

    loss, out = fs(None)
    assert not loss.requires_grad
    assert out["model_output"]["log_probs"].grad_fn is None

    mfs = gradguard.forward_step(check=None)(megatron_forward_step(detach_loss=True))
    output_tensor, loss_func = mfs(None, None)
    loss, report = loss_func(output_tensor)
    assert report["entropy"].grad_fn is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"check": "bogus"}, "check='bogus' is not accepted"),
        ({"check": "reaches_params"}, "needs params="),
        ({"check": "reaches_params", "params": MODEL, "check_every": 0}, "check_every"),
        ({"check_every": "2", "check": "reaches_params", "params": MODEL}, "check_every"),
    ],
)
def test_bad_options_are_clear_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(GradGuardError, match=match):
        gradguard.forward_step(**options)


# --------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------


def test_raise_mode_names_the_path() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        return verl_result()

    with gradguard.enforce(mode="raise", engines="none"):
        with pytest.raises(GraphRetentionError) as info:
            fs(None)
    msg = str(info.value)
    assert "store test_raise_mode_names_the_path.<locals>.fs[1] " in msg  # qualname + the element
    assert "['model_output']['log_probs']" in msg
    assert "['model_output']['entropy']" in msg
    assert msg.startswith("2 tensor(s)")  # the live loss itself is never reported


def test_raise_mode_passes_a_clean_result() -> None:
    loss, _ = verl_result()
    clean = (loss, {"m": torch.tensor(1.0)})

    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        return clean

    with gradguard.enforce(mode="raise", engines="none"):
        assert fs(None) is clean


def test_warn_mode_detaches_and_warns() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        return verl_result()

    with gradguard.enforce(mode="warn", engines="none"):
        with pytest.warns(GraphRetentionWarning, match=r"fs\[1\] .*\n    \['model_output'\]\['log_probs'\]"):
            loss, out = fs(None)
    assert loss.grad_fn is not None
    assert out["model_output"]["log_probs"].grad_fn is None


def test_off_mode_returns_the_result_itself() -> None:
    captured: list[Any] = []

    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        captured.append(verl_result())
        return captured[-1]

    with gradguard.enforce(mode="off", engines="none"):
        assert fs(None) is captured[-1]
    gradguard.set_mode("off")
    assert fs(None) is captured[-1]
    gradguard.set_mode(None)
    assert fs(None) is not captured[-1]


def test_stats_count_the_published_records() -> None:
    @gradguard.forward_step
    def counted_step(micro_batch: Any) -> Any:
        return verl_result()

    for _ in range(3):
        counted_step(None)
    sites = [s for s in gradguard.stats().values() if "counted_step" in s.store]
    assert sum(s.records for s in sites) == 3
    assert sum(s.tensors_detached for s in sites) == 6


_OFF_SCRIPT = r"""
import torch, gradguard

@gradguard.forward_step
def fs(x):
    y = x * 2
    return y.sum(), {"out": y}

x = torch.randn(3, requires_grad=True)
loss, out = fs(x)
assert out["out"].grad_fn is not None  # GRADGUARD=off: the result passes as it is
with gradguard.enforce(mode="raise", engines="none"):
    try:
        fs(x)
    except gradguard.GraphRetentionError:
        print("OK")  # an enforce scope outranks GRADGUARD, also for functions decorated under it
"""


def test_gradguard_off_at_decoration_is_still_outranked_by_enforce() -> None:
    """GRADGUARD=off read when decorating must not beat enforce(mode="raise") at call time."""
    env = {**os.environ, "GRADGUARD": "off"}
    proc = subprocess.run([sys.executable, "-c", _OFF_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


def test_decoration_with_gradguard_on_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADGUARD", "raise")
    _policy.reload_env()

    def original(micro_batch: Any) -> Any:
        return micro_batch

    assert gradguard.forward_step(original) is not original
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(GraphRetentionError):
            gradguard.forward_step(original)(verl_result())


def test_decorating_a_non_callable_says_what_is_accepted() -> None:
    with pytest.raises(TypeError, match="decorates a function or method, got int.*keywords"):
        gradguard.forward_step(0)  # type: ignore[arg-type]


def test_warnings_and_stats_name_the_line_that_called_the_step() -> None:
    """The call site of a published element is the caller of the decorated function (or of the
    wrapped loss_func), never a gradguard or wrapt frame."""

    class Engine:
        @gradguard.forward_step
        def forward_step(self, batch: Any) -> Any:
            return verl_result()

        @staticmethod
        @gradguard.forward_step
        def static_step(batch: Any) -> Any:
            return verl_result()

    @gradguard.forward_step
    def verl_step(batch: Any) -> Any:
        return verl_result()

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    rewrapped = wrapt.FunctionWrapper(verl_step, passthrough)  # someone else's wrapt decorator on top

    @gradguard.forward_step
    def megatron_step(batch: Any) -> Any:
        loss, policy = outputs()
        return policy, lambda output: (loss, {"logits": output})

    here = os.path.abspath(__file__)
    lines = []
    with gradguard.enforce(mode="warn", engines="none"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lines.append(sys._getframe().f_lineno + 1)
        verl_step(None)
        lines.append(sys._getframe().f_lineno + 1)
        Engine().forward_step(None)
        lines.append(sys._getframe().f_lineno + 1)
        Engine.forward_step(Engine(), None)
        lines.append(sys._getframe().f_lineno + 1)
        Engine.forward_step(None, None)  # through the class, self None: wrapt passes the function, no instance
        lines.append(sys._getframe().f_lineno + 1)
        Engine().static_step(None)
        rewrapped(None)  # the site: passthrough's call of verl_step, user code too
        lines.append(passthrough.__code__.co_firstlineno + 1)
        output, loss_func = megatron_step(None)
        lines.append(sys._getframe().f_lineno + 1)
        loss_func(output)
    warned = [(w.filename, w.lineno) for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert warned == [(here, line) for line in lines]
    sites = {s.site for s in gradguard.stats().values() if s.site != "(no graph: site not resolved)"}
    assert sites == {f"{here}:{line}" for line in lines}


# --------------------------------------------------------------------------------------------------
# Results shared with the engine, async functions, ignored options, labels
# --------------------------------------------------------------------------------------------------


def test_a_custom_mapping_result_is_never_mutated() -> None:
    """The engine's own result keeps its graph: a copy.copy sharing its storage made it lose it (w.grad 2.8 -> 1.0)."""
    import collections.abc as abc

    class Result(abc.MutableMapping):  # type: ignore[type-arg]
        def __init__(self, **kw: Any) -> None:
            self._d = dict(kw)

        def __getitem__(self, k: Any) -> Any:
            return self._d[k]

        def __setitem__(self, k: Any, v: Any) -> None:
            self._d[k] = v

        def __delitem__(self, k: Any) -> None:
            del self._d[k]

        def __iter__(self) -> Any:
            return iter(self._d)

        def __len__(self) -> int:
            return len(self._d)

    def run(guarded: bool) -> list[float]:
        w = torch.ones(2, requires_grad=True)
        cache: dict[str, Any] = {}

        def fs(x: torch.Tensor) -> Result:
            r = Result(loss=(w * x).sum(), hidden=w * x * 3)
            cache["last"] = r  # a module caching its last output, for a regulariser
            return r

        out = (gradguard.forward_step(fs, loss="loss") if guarded else fs)(torch.ones(2))
        if guarded:
            assert type(out) is Result and out is not cache["last"]
            assert out["hidden"].grad_fn is None and out["loss"] is cache["last"]["loss"]
        (out["loss"] + 0.1 * cache["last"]["hidden"].pow(2).sum()).backward()
        return w.grad.tolist()  # type: ignore[union-attr]

    assert run(True) == run(False) == pytest.approx([2.8, 2.8])


def test_async_forward_step_is_guarded_and_checked() -> None:
    """An async def is not decorated as if sync: its coroutine must not escape unguarded and unchecked."""
    import asyncio
    import inspect

    x = torch.randn(2, requires_grad=True)

    @gradguard.forward_step
    async def fs(scale: float) -> Any:
        y = x * scale
        return y.sum(), {"y": y}

    assert inspect.iscoroutinefunction(fs)
    loss, out = asyncio.run(fs(2.0))
    assert loss.grad_fn is not None and out["y"].grad_fn is None

    @gradguard.forward_step
    async def bad(scale: float) -> Any:
        y = x * scale
        return y.sum().detach(), {"y": y}

    with pytest.raises(LossContractError):
        asyncio.run(bad(2.0))


def test_generator_functions_are_refused_at_decoration() -> None:
    def steps() -> Any:
        yield (torch.ones(1), {})

    async def async_steps() -> Any:
        yield (torch.ones(1), {})

    for fn, what in ((steps, "a generator function"), (async_steps, "a async generator function")):
        with pytest.raises(GradGuardError, match=what):
            gradguard.forward_step(fn)


def test_params_mean_the_graph_walk_unless_another_check_is_asked() -> None:
    """params= with the default check is not silently ignored."""
    policy, value = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)

    @gradguard.forward_step(params=policy)
    def fs(x: torch.Tensor) -> Any:
        h = policy(x).detach()  # the trap: the policy gets no gradient
        return value(h).mean(), {"h": h}

    with pytest.raises(LossContractError, match="policy|weight"):
        fs(torch.randn(3, 2))
    with pytest.raises(GradGuardError, match=r"params= is read only by check='reaches_params'"):
        gradguard.forward_step(params=policy, check="requires_grad")


def test_a_result_key_whose_repr_raises_does_not_break_the_step() -> None:
    """A key whose repr raises breaks nothing: labels are not built with repr(key) for every key on the clean path."""
    x = torch.randn(2, requires_grad=True)

    class K:
        def __hash__(self) -> int:
            return 1

        def __repr__(self) -> str:
            raise RuntimeError("repr boom")

    key = K()

    @gradguard.forward_step(loss="loss")
    def fs() -> Any:
        return {"loss": (x * 2).sum(), key: 1.0, "g": x * 3}

    out = fs()
    assert out[key] == 1.0 and out["g"].grad_fn is None
    with gradguard.enforce(mode="raise", engines="none"), pytest.raises(gradguard.GraphRetentionError, match="'g'"):
        fs()
