"""megatron-core's real ``forward_backward_no_pipelining`` around a real ``GPTModel``, keeping a graph per micro-batch.

The model is a ``GPTModel`` from the local (non-TE) layer spec, built as the *last stage* of a pipeline
(``pre_process=False``): per micro-batch ``forward_step_func`` makes the activation a previous stage
would send (a fresh leaf that requires grad, as Megatron's P2P receive buffer is) and hands it to
``model.set_input_tensor``. The ``loss_func`` is verl's shape, with the field's mistake: it returns
``(loss, {"log_probs": ..., "entropy": ...})`` with both still carrying the graph, which the schedule
keeps in ``forward_data_store`` to the end: the analytic pin is :func:`pin_bytes` per micro-batch, the
record :func:`record_bytes`. World size 1 on gloo (an in-process ``HashStore``, no port), TP = PP = CP = 1,
CPU initialization of the weights, dropout 0.

On CPU megatron-core needs CUDA in exactly three places of this path; the harness deals with each
narrowly (no ``torch.cuda`` mock): :class:`_CPURedirect` rewrites the device of the one
``torch.zeros(..., device="cuda")`` of the schedule, a CPU tensor is put in the global memory buffer
first, and Megatron's inference RNG tracker is selected. :func:`check_schedule_cuda_lines` refuses a
release whose schedule adds or changes a line that mentions CUDA (:data:`KNOWN_CUDA_LINES`); any
other CUDA use is re-raised as a :class:`~gradguard.GradGuardError` naming the megatron-core line.
On CUDA none of the three applies (the real RNG tracker, seeded; the weights moved after initialization).
The three places and the figures: ``docs/benchmarks.md`` (*Megatron's real schedule*).
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from importlib import metadata
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..._errors import GradGuardError
from .base import Scenario, Size

__all__ = [
    "KNOWN_CUDA_LINES",
    "GPTSchedule",
    "check_schedule_cuda_lines",
    "ensure_world",
    "pin_bytes",
    "record_bytes",
    "scenario",
    "schedule_cuda_lines",
    "teardown_world",
    "unavailable",
    "verl_style_loss",
]

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
ENTRY = "forward_backward_no_pipelining"
LAYERS = 2
HEAD_DIM = 64
ENTROPY_COEFF = 1e-3

# Every source line of the functions in schedules.py that forward_backward_no_pipelining runs (itself
# and what it calls there, transitively) that mentions CUDA, in megatron-core 0.19.2, and what the
# CPU harness does about it.
REDIRECTED = 'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")'
KNOWN_CUDA_LINES: dict[tuple[str, str], str] = {
    (ENTRY, REDIRECTED): "redirected to the CPU (the one call, by the function's code object and line)",
    (ENTRY, "if hasattr(config, 'cuda_graph_impl') and config.cuda_graph_impl == \"local\":"): (
        "not taken: cuda_graph_impl is 'none'"
    ),
    (ENTRY, "create_cudagraphs()"): "not reached: cuda_graph_impl is 'none'",
    ("forward_step", 'context_manager = torch.autocast("cuda", dtype=config.autocast_dtype)'): (
        "not taken: enable_autocast is False"
    ),
}


def unavailable() -> str | None:
    """Why this scenario cannot run here (megatron-core missing or not importable), or ``None``."""
    try:
        _import_megatron()
    except Exception as exc:  # noqa: BLE001 - any import failure means the scenario cannot run
        return f"megatron-core does not import ({type(exc).__name__}: {exc})"
    return None


def _import_megatron() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", absl, ...
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.pipeline_parallel.schedules as schedules

    return schedules


def _version() -> str:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def pin_bytes(size: Size) -> int:
    """What one micro-batch's kept graph pins: the receive buffer and its ``.grad``."""
    return 2 * size.seq * size.batch * size.hidden * size.dtype.itemsize


def record_bytes(size: Size) -> int:
    """One record's own bytes: ``log_probs`` and ``entropy``, ``[batch, seq]`` float32 each."""
    return 2 * size.batch * size.seq * 4


# --------------------------------------------------------------------------------------------------
# The CUDA lines of the schedule
# --------------------------------------------------------------------------------------------------


def _functions_run(tree: ast.Module, entry: str) -> list[ast.FunctionDef]:
    """``entry`` and the module-level functions it calls by name, transitively, in the order found."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    order: list[ast.FunctionDef] = []
    todo = [entry]
    while todo:
        name = todo.pop(0)
        if name in (f.name for f in order) or name not in defs:
            continue
        order.append(defs[name])
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs:
                todo.append(node.id)
    return order


def schedule_cuda_lines(source: str, entry: str = ENTRY) -> dict[tuple[str, str], int]:
    """``{(function, stripped line): line number}`` for every line of code (not comments, not
    docstrings) that mentions ``cuda`` in ``entry`` and the functions of ``source`` it runs."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found: dict[tuple[str, str], int] = {}
    for func in _functions_run(tree, entry):
        first = func.body[0]
        docstring = first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
        for node in ast.walk(func):
            if isinstance(node, ast.Name):
                text, lineno = node.id, node.lineno
            elif isinstance(node, ast.Attribute):
                text, lineno = node.attr, node.lineno
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not docstring:
                text, lineno = node.value, node.lineno
            else:
                continue
            if "cuda" in text.lower():
                found.setdefault((func.name, lines[lineno - 1].strip()), lineno)
    return found


def check_schedule_cuda_lines(schedules: ModuleType, source: str | None = None) -> dict[tuple[str, str], int]:
    """The known CUDA lines with their line numbers; :class:`GradGuardError` if the installed
    megatron-core has others or lacks one (this harness would then not know what it runs on CPU).
    ``source``: the text to check instead of the module's own."""
    path = inspect.getsourcefile(schedules) or "schedules.py"
    found = schedule_cuda_lines(inspect.getsource(schedules) if source is None else source)
    new = sorted(set(found) - set(KNOWN_CUDA_LINES), key=found.__getitem__)
    gone = sorted(set(KNOWN_CUDA_LINES) - set(found))
    if new or gone:
        detail = [f"  new: {path}:{found[k]} in {k[0]}: {k[1]}" for k in new]
        detail += [f"  gone: in {k[0]}: {k[1]} ({KNOWN_CUDA_LINES[k]})" for k in gone]
        raise GradGuardError(
            f"megatron-core {_version()}'s {ENTRY} path mentions CUDA in lines this CPU harness does not "
            "know (it knows those of 0.19.2):\n" + "\n".join(detail) + "\nReview each: redirect what runs on "
            "CPU narrowly in gradguard/_tools/bench/megatron_gpt.py and add it to KNOWN_CUDA_LINES, with what "
            "the harness does about it."
        )
    return found


class _CPURedirect(TorchFunctionMode):
    """Rewrites ``device="cuda"`` to ``"cpu"`` for one call site, and refuses any other CUDA tensor."""

    def __init__(self, code: Any, line: int) -> None:
        super().__init__()
        self._code, self._line = code, line
        self.redirected = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and kwargs.get("device") == "cuda":
            caller = sys._getframe(1)
            if caller.f_code is self._code and caller.f_lineno == self._line:
                kwargs = {**kwargs, "device": "cpu"}
                self.redirected += 1
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in outs):
            caller = sys._getframe(1)
            raise GradGuardError(
                f"{caller.f_code.co_filename}:{caller.f_lineno} ({caller.f_code.co_name}) made a CUDA tensor "
                f"({getattr(func, '__name__', func)}) during the CPU run of megatron-core {_version()}: not a "
                "line this harness redirects. Redirect it narrowly in gradguard/_tools/bench/megatron_gpt.py."
            )
        return out


@contextmanager
def _cuda_named(where: str, cpu: bool = True) -> Iterator[None]:
    """On a CPU run, re-raise torch's CUDA errors as a GradGuardError naming the megatron-core line."""
    if not cpu:  # a CUDA run's own CUDA errors (out of memory, ...) pass as they are
        yield
        return
    try:
        yield
    except GradGuardError:
        raise
    except Exception as exc:  # torch raises AssertionError or RuntimeError; megatron a bare Exception
        text = str(exc)
        if "cuda" not in text.lower() and "nvidia" not in text.lower():
            raise
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/megatron/" in f.filename]
        at = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else "an unknown line"
        raise GradGuardError(
            f"{where}: megatron-core {_version()} reached CUDA on CPU at {at}: {text}. This harness deals "
            "with schedules.py's total_num_tokens, the attention score buffer and the attention-dropout RNG "
            "fork only (see gradguard/_tools/bench/megatron_gpt.py)."
        ) from exc


# --------------------------------------------------------------------------------------------------
# World size 1
# --------------------------------------------------------------------------------------------------

_created_group = False


def ensure_world() -> None:
    """A gloo process group of one rank and Megatron's model-parallel state (TP = PP = CP = 1), once."""
    global _created_group
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _created_group = True
    elif dist.get_world_size() != 1:
        raise GradGuardError(
            f"the megatron-gpt harness runs at world size 1; this process is in a group of {dist.get_world_size()}"
        )
    if not parallel_state.model_parallel_is_initialized():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel_state.initialize_model_parallel()


def teardown_world() -> None:
    """Undo :func:`ensure_world` (Megatron's state, and the process group if it made it)."""
    global _created_group
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    parallel_state.destroy_model_parallel()
    megatron_random.initialize_rng_tracker(force_reset=True)
    if _created_group and dist.is_initialized():
        dist.destroy_process_group()
    _created_group = False


# --------------------------------------------------------------------------------------------------
# The loss and the schedule
# --------------------------------------------------------------------------------------------------

LossFunc = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def verl_style_loss(
    labels: torch.Tensor, advantages: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, Any]]:
    """A policy-gradient loss with an entropy bonus, and verl's report, *undetached*: the field's mistake.

    Both ``log_probs`` and ``entropy`` are in the loss, so backward frees their saved tensors: what a
    kept report then pins is the graph's leaf (the receive buffer) and its ``.grad``.
    """
    logp = output_tensor.float().log_softmax(-1)  # [batch, seq, vocab]
    log_probs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = -(advantages * log_probs).mean() - ENTROPY_COEFF * entropy.mean()
    return loss, {"log_probs": log_probs, "entropy": entropy}


class GPTSchedule:
    """A ``GPTModel`` built as a pipeline's last stage, and megatron's no-pipelining schedule around it.

    ``run(n, after_microbatch)`` runs one ``forward_backward_no_pipelining`` call of ``n`` micro-batches
    and returns its ``forward_data_store``. ``after_microbatch()`` is called once after each
    micro-batch's backward, with nothing of it alive but what the store keeps: for micro-batch ``k <
    n - 1`` at the start of ``forward_step_func`` for ``k + 1`` (``forward_step`` has already dropped
    the model's input tensor), for the last one in the schedule's ``finalize_model_grads_func`` hook
    (where Megatron-LM reduces gradients across data-parallel ranks; with one rank there is nothing to
    reduce), after dropping the model's reference to the last receive buffer. Inputs derive from the
    micro-batch index, weights from ``seed``: two instances compute bitwise the same.
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        size: Size | None = None,
        *,
        layers: int = LAYERS,
        seed: int = 0,
        loss_func: LossFunc = verl_style_loss,
    ) -> None:
        self.device = torch.device(device)
        self.size = size = Size() if size is None else size
        if size.hidden % HEAD_DIM:
            raise GradGuardError(
                f"megatron-gpt needs a hidden size that is a multiple of {HEAD_DIM}, got {size.hidden}"
            )
        self.loss_func = loss_func
        self.losses: list[float] = []
        self.buffers: list[Any] = []  # weak references to each micro-batch's receive buffer
        self._schedules = _import_megatron()
        self._cpu = self.device.type == "cpu"
        self.cuda_lines = check_schedule_cuda_lines(self._schedules) if self._cpu else {}
        with _cuda_named("building the GPTModel", self._cpu):
            self.model: Any = self._build(layers, seed)  # a GPTModel (megatron-core is untyped)
        self._mask = torch.ones(1, 1, size.seq, size.seq, dtype=torch.bool, device=self.device).triu(1)
        self.redirected = 0  # calls of the redirected line, over every run

    def _build(self, layers: int, seed: int) -> Any:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import random as megatron_random
        from megatron.core.transformer import TransformerConfig

        ensure_world()
        size = self.size
        heads = size.hidden // HEAD_DIM
        if self._cpu:
            megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            buffer = parallel_state.get_global_memory_buffer().buffer
            need = size.batch * heads * size.seq * size.seq
            key = ("mpu", size.dtype)  # DotProductAttention's name for its score buffer
            if key not in buffer or buffer[key].numel() < need:
                buffer[key] = torch.empty(need, dtype=size.dtype)
        else:
            megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        torch.manual_seed(seed)
        with warnings.catch_warnings(), _quiet("megatron.core.models.gpt.gpt_model"):
            warnings.simplefilter("ignore")  # config deprecations ("full scope is deprecated")
            config = TransformerConfig(
                num_layers=layers,
                hidden_size=size.hidden,
                num_attention_heads=heads,
                use_cpu_initialization=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                params_dtype=size.dtype,
                pipeline_dtype=size.dtype,
                bf16=size.dtype == torch.bfloat16,
                fp16=size.dtype == torch.float16,
            )
            model = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=size.vocab,
                max_sequence_length=size.seq,
                pre_process=False,  # the last stage: its input is what the previous stage sent
                post_process=True,
                share_embeddings_and_output_weights=False,
            )
        # torch's LayerNorm ignores params_dtype; for bf16/fp16 Megatron-LM casts the whole model
        # (Float16Module), and so does this
        return model.to(device=self.device, dtype=size.dtype)

    def _forward_step_func(
        self, after_microbatch: Callable[[], None], data_iterator: Iterator[int], model: Any
    ) -> tuple[torch.Tensor, Any]:
        k = next(data_iterator)
        if k:
            after_microbatch()
        size, device = self.size, self.device
        g = torch.Generator(device=device).manual_seed(k)
        shape = (size.seq, size.batch, size.hidden)
        # Megatron's P2P receive buffer (create_tensor_recv_prev): a fresh leaf that requires grad.
        recv = torch.empty(shape, device=device, dtype=size.dtype, requires_grad=True)
        with torch.no_grad():
            recv.copy_(torch.randn(shape, device=device, generator=g, dtype=size.dtype))
        self.buffers.append(weakref.ref(recv))
        labels = torch.randint(size.vocab, (size.batch, size.seq), device=device, generator=g)
        advantages = torch.randn(size.batch, size.seq, device=device, generator=g)
        model.set_input_tensor(recv)
        logits = model(input_ids=None, position_ids=None, attention_mask=self._mask)  # [batch, seq, vocab]
        return logits, partial(self._loss, labels, advantages)

    def _loss(self, labels: torch.Tensor, advantages: torch.Tensor, output_tensor: torch.Tensor) -> Any:
        loss, report = self.loss_func(labels, advantages, output_tensor)
        self.losses.append(loss.item())  # before the schedule scales it in place
        return loss, report

    def run(self, micro_batches: int, after_microbatch: Callable[[], None] | None = None) -> list[Any]:
        """One schedule call of ``micro_batches`` micro-batches; returns its ``forward_data_store``."""
        after = after_microbatch or (lambda: None)

        def finalize(*args: Any, **kwargs: Any) -> None:
            self.model.set_input_tensor(None)
            after()

        self.losses, self.buffers = [], []
        config = self.model.config
        config.finalize_model_grads_func = finalize
        redirect = self._redirect() if self._cpu else None
        try:
            with _cuda_named(f"running {ENTRY}", self._cpu), redirect or _nothing():
                store: list[Any] = self._schedules.forward_backward_no_pipelining(
                    forward_step_func=partial(self._forward_step_func, after),
                    data_iterator=iter(range(micro_batches)),
                    model=self.model,
                    num_microbatches=micro_batches,
                    seq_length=self.size.seq,
                    micro_batch_size=self.size.batch,
                )
        finally:
            config.finalize_model_grads_func = None
            self.model.set_input_tensor(None)
        if redirect is not None:
            if redirect.redirected != 1:
                raise GradGuardError(
                    f"{ENTRY} ran {redirect.redirected} times through the redirected line "
                    f"({REDIRECTED!r}), expected once: the schedule changed"
                )
            self.redirected += 1
        return store

    def _redirect(self) -> _CPURedirect:
        line = self.cuda_lines[(ENTRY, REDIRECTED)]
        return _CPURedirect(inspect.unwrap(getattr(self._schedules, ENTRY)).__code__, line)

    def grads(self) -> list[torch.Tensor | None]:
        """Copies of the parameters' gradients, in ``named_parameters`` order."""
        return [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Megatron logs "GPTModel IS DEPRECATED" at every construction; not this benchmark's subject."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------
# The bench scenario
# --------------------------------------------------------------------------------------------------


def scenario(device: torch.device, size: Size) -> Scenario:
    """``gradguard bench --scenario megatron-gpt``: the schedule drives the micro-batches; the guarded
    run enters ``gradguard.enforce(engines=["megatron"])``, nothing else changes."""
    harness = GPTSchedule(device, size)

    def run(micro_batches: int, guarded: bool, after_microbatch: Callable[[], None]) -> Any:
        return harness.run(micro_batches, after_microbatch)

    def not_a_step(i: int, store: Any, guarded: bool) -> None:
        raise GradGuardError("megatron-gpt's schedule runs the micro-batches itself: call Scenario.run")

    return Scenario(
        "megatron-gpt",
        harness.model,
        pin_bytes(size),
        record_bytes(size),
        not_a_step,
        lambda guarded: [],
        engines=("megatron",),
        run=run,
    )
