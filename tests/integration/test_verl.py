"""verl adapter, proven on the real verl engine classes on CPU.

verl's engines cannot be constructed on CPU (their ``__init__`` builds an HF model under FSDP/CUDA), so
each test subclasses the real engine class and overrides only ``__init__`` plus the model plumbing
(``prepare_model_inputs`` / ``prepare_model_outputs``, a tiny LM). What runs is verl's own code:
``FSDPEngine.forward_backward_batch`` (the loop that fills ``output_lst``, backprops each loss and
hands the list to ``postprocess_batch_func``), ``FSDPEngineWithLMHead.forward_step`` and
``MegatronEngineWithLMHead.postprocess_micro_batch_func`` (Megatron's ``loss_func``; Megatron's own
schedule hard-codes CUDA, so the test appends to a list the way ``forward_data_store`` does).

verl 0.9.1 already detaches (``verl.workers.engine.utils.detach_tree``, PR #7874). The pre-fix
behaviour is reproduced two ways: in process by replacing the ``detach_tree`` name the engine modules
imported with an identity function, and, when ``GRADGUARD_VERL_OLD`` points at an unpacked verl 0.8.0
wheel, by running the same scenarios on that release in a subprocess (where ``enforce`` is entered
before verl is imported).

Leak probe: the ``entropy`` head goes through ``Pin``, an autograd node that saves a fresh buffer and
is never back-propagated (the loss uses ``log_probs`` only), so the buffer lives exactly as long as
something references the entropy tensor's graph.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import wrapt
from _helpers import require_engine

import gradguard
from gradguard.engines import verl as verl_adapter

pytestmark = pytest.mark.integration

FSDP = "verl.workers.engine.fsdp.transformer_impl"
MEGATRON = "verl.workers.engine.megatron.transformer_impl"
V, H, T, B, MBS = 11, 8, 6, 8, 2
N_MICRO = B // MBS
OLD_ENV = "GRADGUARD_VERL_OLD"  # an unpacked verl 0.8.0 wheel (pip download --no-deps verl==0.8.0)
TIMEOUT_S = 300

# --------------------------------------------------------------------------------------------------
# Probe, tiny model, data
# --------------------------------------------------------------------------------------------------

LIVE: list[weakref.ref[torch.Tensor]] = []


class Pin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(1024)
        LIVE.append(weakref.ref(buf))
        ctx.save_for_backward(buf)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def alive() -> int:
    gc.collect()
    return sum(r() is not None for r in LIVE)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))


def heads(logits: torch.Tensor, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    lp = torch.log_softmax(logits.float(), -1)
    log_probs = lp.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    entropy = Pin.apply(-(lp.exp() * lp).sum(-1))  # side branch the loss never backprops
    return {"log_probs": log_probs, "entropy": entropy}


class LossFn:
    """verl's ``loss_function(model_output, data, dp_group) -> (loss, metrics)``; remembers its losses."""

    def __init__(self, detach: bool = False) -> None:
        self.detach, self.losses = detach, []

    def __call__(self, model_output: dict[str, Any], data: Any, dp_group: Any = None) -> Any:
        mask = data["loss_mask"]
        loss = -(model_output["log_probs"] * mask).sum() / mask.sum()
        loss = loss.detach() if self.detach else loss
        self.losses.append(loss)
        return loss, {"actor/pg_loss": loss.detach().item()}


def make_data(return_model_output: bool = True) -> Any:
    import verl.utils.tensordict_utils as tu
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(1)
    td = TensorDict(
        {"input_ids": torch.randint(0, V, (B, T), generator=g), "loss_mask": torch.ones(B, T)}, batch_size=[B]
    )
    tu.assign_non_tensor(
        td, use_dynamic_bsz=False, micro_batch_size_per_gpu=MBS, return_model_output=return_model_output
    )
    return td


def micro_batches() -> list[Any]:
    import verl.utils.tensordict_utils as tu

    data = make_data()
    out = []
    for i in range(N_MICRO):
        mb = data[i * MBS : (i + 1) * MBS]
        tu.assign_non_tensor(mb, num_micro_batch=N_MICRO)
        out.append(mb)
    return out


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------------
# Fake engines: the real classes with __init__ and the model plumbing replaced
# --------------------------------------------------------------------------------------------------


def fsdp_engine(fsdp: ModuleType) -> Any:
    class FakeFSDPEngine(fsdp.FSDPEngineWithLMHead):
        def __init__(self) -> None:  # the real one builds an HF model under FSDP on CUDA
            self.module = TinyLM()
            self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=False)
            self.ulysses_sequence_parallel_size = 1
            self.scaler = None
            self._autocast_dtype = torch.float32

        def get_data_parallel_group(self) -> Any:
            return dist.group.WORLD

        def get_data_parallel_size(self) -> int:
            return 1

        def prepare_model_inputs(self, micro_batch: Any) -> Any:
            return {"input_ids": micro_batch["input_ids"]}, {"input_ids": micro_batch["input_ids"]}

        def prepare_model_outputs(
            self, output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any = None
        ) -> Any:
            return heads(output.logits, output_args["input_ids"])

    return FakeFSDPEngine()


def megatron_engine(meg: ModuleType, per_token: bool = False) -> Any:
    class FakeMegatronEngine(meg.MegatronEngineWithLMHead):
        def __init__(self) -> None:
            self.module = TinyLM()
            self.engine_config = SimpleNamespace(
                dynamic_context_parallel=False, use_remove_padding=True, context_parallel_size=1
            )
            self.tf_config = SimpleNamespace(calculate_per_token_loss=True) if per_token else None

        def get_data_parallel_group(self) -> Any:
            return None

        def prepare_model_outputs(self, output: Any, data: Any) -> Any:
            return heads(output, data["input_ids"])

    return FakeMegatronEngine()


def run_fsdp(fsdp: ModuleType, loss_fn: LossFn | None = None, **kw: Any) -> dict[str, Any]:
    """verl's real ``forward_backward_batch``; ``output_lst`` is captured on its way to postprocessing."""
    engine, loss_fn = fsdp_engine(fsdp), loss_fn or LossFn()
    captured: list[Any] = []
    post = fsdp.postprocess_batch_func

    def capture(output_lst: list[Any], **k: Any) -> Any:
        captured.append(output_lst)
        return post(output_lst=output_lst, **k)

    LIVE.clear()
    fsdp.postprocess_batch_func = capture
    try:
        result = engine.forward_backward_batch(
            make_data(kw.pop("return_model_output", True)), loss_function=loss_fn, **kw
        )
    finally:
        fsdp.postprocess_batch_func = post
    (records,) = captured
    graphs = [gradguard.find_graphs(r) for r in records]
    return {
        "records": records, "result": result, "engine": engine, "loss_fn": loss_fn,
        "graphs": sum(map(len, graphs)), "pinned": alive(),
        "grads": None if kw.get("forward_only") else grads(engine.module),
    }  # fmt: skip


def run_megatron(meg: ModuleType, loss_fn: LossFn | None = None, per_token: bool = False) -> dict[str, Any]:
    """Megatron's per-micro-batch contract: ``loss_func(output_tensor)`` -> backward ``res[0]``, store ``res[-1]``.

    ``loss_func`` is built the way verl's ``forward_backward_batch`` / ``forward_step`` build it, so
    ``self.postprocess_micro_batch_func`` is looked up on the instance (the patched class attribute).
    """
    engine, loss_fn = megatron_engine(meg, per_token), loss_fn or LossFn()
    forward_data_store, firsts = [], []
    LIVE.clear()
    for mb in micro_batches():
        output_tensor = engine.module(mb["input_ids"]).logits
        loss_func = partial(
            partial(engine.postprocess_micro_batch_func, forward_only=False, loss_function=loss_fn),
            data=mb, local_cp_size=None,
        )  # fmt: skip
        res = loss_func(output_tensor)
        firsts.append(res[0])
        res[0].backward()
        forward_data_store.append(res[-1])
    return {
        "store": forward_data_store, "firsts": firsts, "loss_fn": loss_fn, "engine": engine,
        "graphs": len(gradguard.find_graphs(forward_data_store)), "pinned": alive(), "grads": grads(engine.module),
        "arity": len(res),
    }  # fmt: skip


def derives_from(out: torch.Tensor, loss: torch.Tensor, depth: int = 3) -> bool:
    """``out`` was computed from ``loss`` itself within ``depth`` autograd steps (no detach between)."""
    frontier = [out.grad_fn]
    for _ in range(depth):
        if any(fn is loss.grad_fn for fn in frontier):
            return True
        frontier = [nxt for fn in frontier if fn is not None for nxt, _ in fn.next_functions]
    return any(fn is loss.grad_fn for fn in frontier)


def no_detach(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType | None) -> None:
    """Reproduce verl < 0.9.1: the engines' own ``detach_tree`` becomes the identity."""
    for module in modules:
        if module is not None:
            monkeypatch.setattr(module, "detach_tree", lambda obj: obj)


def store_rows(label: str) -> list[gradguard.SiteStats]:
    return [s for (store, _), s in gradguard.stats().items() if store == label]


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


def _setup(fsdp: ModuleType) -> Callable[[], None]:
    """Single-process gloo group (``forward_backward_batch`` all-reduces the token count) and a CPU device
    (verl has no CPU platform: its ``get_device_id`` falls back to CUDA and asserts)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saved = fsdp.get_device_name, fsdp.get_device_id
    fsdp.get_device_name, fsdp.get_device_id = (lambda: "cpu"), (lambda: "cpu")

    def teardown() -> None:
        fsdp.get_device_name, fsdp.get_device_id = saved
        if created:
            dist.destroy_process_group()

    return teardown


@pytest.fixture(scope="module")
def verl() -> Iterator[SimpleNamespace]:
    fsdp = require_engine(FSDP)  # imports every installed backend, megatron's too (verl's engine package)
    meg = sys.modules.get(MEGATRON)
    # verl + ray + transformers leave ~10^6 objects for every gc.collect() below to scan: freeze them.
    gc.collect()
    gc.freeze()
    teardown = _setup(fsdp)
    try:
        yield SimpleNamespace(fsdp=fsdp, meg=meg)
    finally:
        teardown()
        gc.unfreeze()


@pytest.fixture
def meg(verl: SimpleNamespace) -> ModuleType:
    return verl.meg if verl.meg is not None else require_engine(MEGATRON)


# --------------------------------------------------------------------------------------------------
# (a) install / restore on the real classes
# --------------------------------------------------------------------------------------------------


def test_enforce_patches_the_imported_engines_and_restores_the_originals(
    verl: SimpleNamespace, meg: ModuleType
) -> None:
    fsdp = verl.fsdp
    fs = vars(fsdp.FSDPEngineWithLMHead)["forward_step"]
    base = vars(fsdp.FSDPEngine)["forward_step"]
    pp = vars(meg.MegatronEngineWithLMHead)["postprocess_micro_batch_func"]
    with gradguard.enforce(engines=["verl"]):
        wrapped = vars(fsdp.FSDPEngineWithLMHead)["forward_step"]
        assert isinstance(wrapped, wrapt.FunctionWrapper) and wrapped.__wrapped__ is fs
        assert vars(fsdp.FSDPEngine)["forward_step"] is base  # the NotImplementedError stub is left alone
        # subclasses that inherit it (value head, and VeOmni's engines where installed) go through it
        assert "forward_step" not in vars(fsdp.FSDPEngineWithValueHead)
        assert fsdp.FSDPEngineWithValueHead.forward_step.__wrapped__ is fs
        wrapped_pp = vars(meg.MegatronEngineWithLMHead)["postprocess_micro_batch_func"]
        assert isinstance(wrapped_pp, wrapt.FunctionWrapper) and wrapped_pp.__wrapped__ is pp
        with gradguard.enforce(engines=["verl"]):  # nested: still the one wrapper
            assert vars(fsdp.FSDPEngineWithLMHead)["forward_step"] is wrapped
        assert vars(fsdp.FSDPEngineWithLMHead)["forward_step"] is wrapped
    assert vars(fsdp.FSDPEngineWithLMHead)["forward_step"] is fs
    assert vars(meg.MegatronEngineWithLMHead)["postprocess_micro_batch_func"] is pp
    with gradguard.enforce(engines=["megatron"]):  # another adapter leaves verl alone
        assert vars(fsdp.FSDPEngineWithLMHead)["forward_step"] is fs


# --------------------------------------------------------------------------------------------------
# (b) verl 0.9.1 already detaches: the guard is a no-op
# --------------------------------------------------------------------------------------------------


def test_fixed_release_is_left_as_is(verl: SimpleNamespace) -> None:
    fsdp = verl.fsdp
    plain = run_fsdp(fsdp)
    if plain["graphs"]:
        pytest.skip(f"this verl ({verl_adapter.version()}) does not detach model_output itself")
    assert plain["pinned"] == 0
    with gradguard.enforce(engines=["verl"]):
        guarded = run_fsdp(fsdp)
        engine, loss_fn = fsdp_engine(fsdp), LossFn()
        loss, record = engine.forward_step(micro_batches()[0], loss_function=loss_fn, forward_only=False)
    assert guarded["graphs"] == 0 and guarded["pinned"] == 0
    assert same(guarded["grads"], plain["grads"])
    assert loss is loss_fn.losses[-1] and loss.grad_fn is not None  # the live loss, not a copy
    assert record["model_output"]["log_probs"].grad_fn is None
    (row,) = store_rows("verl FSDPEngineWithLMHead.forward_step[1]")
    assert row.records == N_MICRO + 1 and row.tensors_detached == 0


# --------------------------------------------------------------------------------------------------
# (c) defense in depth: verl's own detach disabled (the pre-0.9.1 behaviour)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_model_output", [True, False])
def test_unfixed_fsdp_engine_is_guarded(
    verl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, return_model_output: bool
) -> None:
    fsdp = verl.fsdp
    no_detach(monkeypatch, fsdp)
    leaky = run_fsdp(fsdp, return_model_output=return_model_output)
    if return_model_output:  # 0.9.1's loop pops model_output otherwise (0.8.0 did not)
        assert leaky["graphs"] == 2 * N_MICRO  # log_probs and entropy of every micro-batch
        assert leaky["pinned"] == N_MICRO  # every micro-batch's graph alive in output_lst
        assert any(t.grad_fn is not None for t in leaky["result"]["model_output"].values())
    del leaky["records"], leaky["result"]
    assert alive() == 0

    with gradguard.enforce(engines=["verl"]):
        guarded = run_fsdp(fsdp, return_model_output=return_model_output)
    assert guarded["graphs"] == 0 and guarded["pinned"] == 0
    assert same(guarded["grads"], leaky["grads"])
    for loss in guarded["loss_fn"].losses:
        assert loss.grad_fn is not None  # what verl backpropagated was the live loss
    (row,) = store_rows("verl FSDPEngineWithLMHead.forward_step[1]")
    assert row.tensors_detached == 2 * N_MICRO
    file, _, line = row.site.rpartition(":")  # attributed to verl's loop, not to gradguard or wrapt
    assert file.endswith(os.path.join("verl", "workers", "engine", "fsdp", "transformer_impl.py")) and int(line) > 0


def test_unfixed_fsdp_engine_strict_mode_refuses(verl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    no_detach(monkeypatch, verl.fsdp)
    with (
        gradguard.enforce(mode="raise", engines=["verl"]),
        pytest.raises(gradguard.GraphRetentionError, match="model_output"),
    ):
        run_fsdp(verl.fsdp)


# --------------------------------------------------------------------------------------------------
# (d) Megatron engine: postprocess_micro_batch_func is Megatron's loss_func
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_token", [False, True], ids=["2-tuple", "per-token 3-tuple"])
def test_unfixed_megatron_loss_func_is_guarded(
    verl: SimpleNamespace, meg: ModuleType, monkeypatch: pytest.MonkeyPatch, per_token: bool
) -> None:
    no_detach(monkeypatch, meg)
    leaky = run_megatron(meg, per_token=per_token)
    assert leaky["arity"] == (3 if per_token else 2)
    assert leaky["graphs"] == 2 * N_MICRO and leaky["pinned"] == N_MICRO
    del leaky["store"]
    assert alive() == 0

    with gradguard.enforce(engines=["verl"]):
        guarded = run_megatron(meg, per_token=per_token)
    assert guarded["graphs"] == 0 and guarded["pinned"] == 0
    assert same(guarded["grads"], leaky["grads"])
    for first, loss in zip(guarded["firsts"], guarded["loss_fn"].losses):
        # the scaled loss verl computed from the loss function's live loss, handed back unchanged
        assert first.requires_grad and derives_from(first, loss)
    # the output is the last element: [1] of (scaled_loss, output), [2] of (sum, num_tokens, output)
    (row,) = store_rows(f"verl MegatronEngineWithLMHead.postprocess_micro_batch_func[{guarded['arity'] - 1}]")
    assert row.tensors_detached == 2 * N_MICRO


def test_fixed_megatron_loss_func_is_left_as_is(verl: SimpleNamespace, meg: ModuleType) -> None:
    plain = run_megatron(meg)
    if plain["graphs"]:
        pytest.skip("this verl does not detach model_output in postprocess_micro_batch_func itself")
    with gradguard.enforce(engines=["verl"]):
        guarded = run_megatron(meg)
    assert guarded["graphs"] == 0 and same(guarded["grads"], plain["grads"])
    (row,) = store_rows("verl MegatronEngineWithLMHead.postprocess_micro_batch_func[1]")
    assert row.records == N_MICRO and row.tensors_detached == 0


# --------------------------------------------------------------------------------------------------
# (e) the loss contract: forward-only calls are not checked; a detached training loss warns
# --------------------------------------------------------------------------------------------------


def test_forward_only_calls_are_not_loss_checked(
    verl: SimpleNamespace, meg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_detach(monkeypatch, verl.fsdp, meg)
    mb = micro_batches()[0]
    with gradguard.enforce(engines=["verl"]), warnings.catch_warnings():
        warnings.simplefilter("error", gradguard.LossContractWarning)
        # verl's infer path: forward_backward_batch(forward_only=True) under no_grad, loss_function=None
        out = run_fsdp(verl.fsdp, forward_only=True)
        assert out["graphs"] == 0
        # forward-only with grad enabled and a loss that needs no grad, keyword and positional
        engine = fsdp_engine(verl.fsdp)
        engine.forward_step(mb, loss_function=LossFn(detach=True), forward_only=True)
        _, record = engine.forward_step(mb, LossFn(detach=True), True)
        assert not gradguard.find_graphs(record)  # published all the same
        m = megatron_engine(meg)
        output = m.module(mb["input_ids"]).logits
        loss, report = m.postprocess_micro_batch_func(output, data=mb, forward_only=True, loss_function=None)
        assert not loss.requires_grad and not gradguard.find_graphs(report)


def test_detached_training_loss_warns(verl: SimpleNamespace, meg: ModuleType) -> None:
    mb = micro_batches()[0]
    with gradguard.enforce(engines=["verl"]):
        with pytest.warns(gradguard.LossContractWarning):
            fsdp_engine(verl.fsdp).forward_step(mb, loss_function=LossFn(detach=True), forward_only=False)
        # through verl's loop: the warning comes first, then verl's own backward fails on the same loss
        with pytest.warns(gradguard.LossContractWarning), pytest.raises(RuntimeError, match="does not require grad"):
            run_fsdp(verl.fsdp, LossFn(detach=True))
        m = megatron_engine(meg)
        with pytest.warns(gradguard.LossContractWarning):
            m.postprocess_micro_batch_func(
                m.module(mb["input_ids"]).logits, data=mb, forward_only=False, loss_function=LossFn(detach=True)
            )
        with warnings.catch_warnings():  # a live training loss: no warning
            warnings.simplefilter("error", gradguard.LossContractWarning)
            fsdp_engine(verl.fsdp).forward_step(mb, loss_function=LossFn(), forward_only=False)


# --------------------------------------------------------------------------------------------------
# (f) mode="off"
# --------------------------------------------------------------------------------------------------


def test_mode_off_passes_through(verl: SimpleNamespace, meg: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    no_detach(monkeypatch, verl.fsdp, meg)
    with gradguard.enforce(mode="off", engines=["verl"]):
        assert isinstance(vars(verl.fsdp.FSDPEngineWithLMHead)["forward_step"], wrapt.FunctionWrapper)
        out = run_fsdp(verl.fsdp)
        m = run_megatron(meg)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gradguard.LossContractWarning)  # off: no loss check either
            fsdp_engine(verl.fsdp).forward_step(
                micro_batches()[0], loss_function=LossFn(detach=True), forward_only=False
            )
    assert out["graphs"] == 2 * N_MICRO and out["pinned"] == N_MICRO
    assert m["graphs"] == 2 * N_MICRO
    assert not gradguard.stats()


# --------------------------------------------------------------------------------------------------
# The real pre-fix release (verl 0.8.0), in a subprocess; enforce is entered before verl is imported
# --------------------------------------------------------------------------------------------------


def _old_release_main() -> None:
    """Run in a subprocess with ``PYTHONPATH=$GRADGUARD_VERL_OLD``; prints one JSON line."""
    warnings.simplefilter("ignore")
    import importlib

    out: dict[str, Any] = {}
    with gradguard.enforce(engines=["verl"]):  # before verl is imported: the post-import hook patches it
        fsdp = importlib.import_module(FSDP)
        meg = sys.modules.get(MEGATRON)
        import verl as verl_pkg

        out["version"], out["file"] = verl_pkg.__version__, verl_pkg.__file__
        out["patched"] = isinstance(vars(fsdp.FSDPEngineWithLMHead)["forward_step"], wrapt.FunctionWrapper)
        teardown = _setup(fsdp)
        gc.collect()
        gc.freeze()
        g = run_fsdp(fsdp)
        out["guarded"] = {"graphs": g["graphs"], "pinned": g["pinned"]}
        if meg is not None:
            gm = run_megatron(meg)
            out["meg_guarded"] = {"graphs": gm["graphs"], "pinned": gm["pinned"]}
    out["restored"] = not isinstance(vars(fsdp.FSDPEngineWithLMHead)["forward_step"], wrapt.ObjectProxy)
    p = run_fsdp(fsdp)
    out["plain"] = {"graphs": p["graphs"], "pinned": p["pinned"]}
    out["grads_equal"] = same(g["grads"], p["grads"])
    if meg is not None:
        pm = run_megatron(meg)
        out["meg_plain"] = {"graphs": pm["graphs"], "pinned": pm["pinned"]}
        out["meg_grads_equal"] = same(gm["grads"], pm["grads"])
    teardown()
    print("RESULT " + json.dumps(out))


def test_old_release_080_in_subprocess() -> None:
    old = os.environ.get(OLD_ENV)
    if not old:
        reason = f"set {OLD_ENV} to an unpacked verl 0.8.0 wheel to run the pre-fix release"
        if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
            pytest.fail(f"GRADGUARD_REQUIRE_ENGINES=1: {reason}")
        pytest.skip(reason)
    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path[:0] = [{str(here.parent)!r}, {str(here)!r}]; "
        "import test_verl; test_verl._old_release_main()"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([old, os.environ.get("PYTHONPATH", "")])}
    env.pop("GRADGUARD", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["file"].startswith(old), res
    assert res["patched"] and res["restored"], res
    assert res["plain"] == {"graphs": 2 * N_MICRO, "pinned": N_MICRO}, res  # 0.8.0 leaks
    assert res["guarded"] == {"graphs": 0, "pinned": 0}, res
    assert res["grads_equal"], res
    if "meg_plain" in res:
        assert res["meg_plain"] == {"graphs": 2 * N_MICRO, "pinned": N_MICRO}, res
        assert res["meg_guarded"] == {"graphs": 0, "pinned": 0} and res["meg_grads_equal"], res
