"""verl engines: defense in depth for releases that published ``model_output`` with its graph.

Before verl 0.9.1 (PR #7874) the Megatron, TorchTitan and AutoModel engines (and, before 0.9.0, all
engines) kept each micro-batch's ``model_output`` undetached in their per-mini-batch output list. The
adapter wraps, where each engine defines it:

* ``FSDPEngineWithLMHead.forward_step`` (VeOmni's engines inherit it),
  ``AutomodelEngineWithLMHead.forward_step``, ``TorchTitanEngineWithLMHead.forward_step``: the result
  ``(loss, {"model_output": ..., "loss": float, "metrics": ...})`` keeps ``loss`` live and checked
  (unless ``forward_only``) and publishes the rest through the active mode;
* ``MegatronEngineWithLMHead.postprocess_micro_batch_func`` (Megatron's ``loss_func``; the Mindspeed
  and value-head engines inherit it): ``(scaled_loss, output)`` or ``(local_sum, num_tokens, output)``
  keeps its first element live and checked and publishes the rest.

On 0.9.1, which detaches itself, the cost is one walk that finds nothing to do. A loss that does not
require grad in a training step is a :class:`gradguard.LossContractWarning` (verl's own backward
would fail next). The adapter never imports verl: it waits for the engine modules to be imported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from .._guards import patch as _patch
from .._guards.arguments import MISSING, Argument
from .._guards.contract import LossCheck
from .._guards.results import Labels, guard_result
from ._adapter import Adapter

__all__ = ["ADAPTER"]

_PKG = "verl.workers.engine"
TARGETS: dict[str, tuple[tuple[str, str], ...]] = {
    f"{_PKG}.fsdp.transformer_impl": (("FSDPEngineWithLMHead", "forward_step"),),
    f"{_PKG}.automodel.transformer_impl": (("AutomodelEngineWithLMHead", "forward_step"),),
    f"{_PKG}.torchtitan.transformer_impl": (("TorchTitanEngineWithLMHead", "forward_step"),),
    f"{_PKG}.megatron.transformer_impl": (("MegatronEngineWithLMHead", "postprocess_micro_batch_func"),),
}
_loss_check = LossCheck("requires_grad", on_violation="warn", name="verl engine loss")


def _wrapper(method: Any, label: str) -> Any:
    """Keep the loss live and checked in training calls; publish the rest of the result."""
    labels = Labels(label)
    forward_only = Argument(method, "forward_only", what=f"verl's {label}")

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        only = forward_only.get(instance, args, kwargs)
        train = torch.is_grad_enabled() and not (only is not MISSING and only)
        return guard_result(result, 0, labels, _loss_check if train else None)

    return wrapper


class VerlAdapter(Adapter):
    """Keeps verl engines' loss live and checked and publishes the rest of each micro-batch's result."""

    name = "verl"
    modules = tuple(TARGETS)
    package = "verl"
    supported = ">=0.8,<0.10"

    def instrument(self, module: ModuleType) -> None:
        """Patch the engine classes ``module`` defines (idempotent); a class it lacks is skipped."""
        for cls_name, attr in TARGETS.get(module.__name__, ()):
            cls = getattr(module, cls_name, None)
            if cls is not None and attr in vars(cls) and not _patch.is_installed(cls, attr):
                _patch.install(cls, attr, _wrapper(vars(cls)[attr], f"verl {cls_name}.{attr}"))

    def uninstrument(self, module: ModuleType) -> None:
        """Restore the original methods."""
        for cls_name, attr in TARGETS.get(module.__name__, ()):
            cls = getattr(module, cls_name, None)
            if cls is not None:
                _patch.uninstall(cls, attr)


ADAPTER = VerlAdapter()
