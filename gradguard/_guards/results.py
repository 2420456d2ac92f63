"""The result shapes of a forward step, shared by ``@forward_step`` and the engine adapters.

* verl style ``(loss, output, ...)``, a list, a namedtuple, or a mapping: the element at ``loss_key``
  stays live and is checked; every other element is published as its own record, into the store
  ``"{label}[{key!r}]"`` (messages then show paths such as ``['model_output']['log_probs']``). A result
  with nothing to detach comes back as itself; a changed one is an exact copy of its type (items
  written at C level, state kept), the loss the very same object. The input is never mutated.
* Megatron style: ``loss_func`` returns ``(loss, [num_tokens,] report)``, or with
  ``non_loss_data=True`` data that is all published.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._boundary.publish import publish
from .._errors import GradGuardError
from .._policy.modes import OFF, resolve
from .._tree.containers import safe_repr, spec_for
from .._tree.walk import substitute
from .contract import LossCheck

__all__ = ["Labels", "guard_loss_func", "guard_result", "with_items"]


class Labels:
    """Store labels of a result's elements, ``"{label}[{key!r}]"``; kept for str/int keys only.

    A key whose ``repr`` raises is named by its type; keys of other types are labelled afresh each
    time, so a result keyed by new objects at every call does not grow this cache.
    """

    __slots__ = ("label", "_cache")

    def __init__(self, label: str) -> None:
        self.label = label
        self._cache: dict[Any, str] = {}

    def __getitem__(self, key: Any) -> str:
        name = self._cache.get(key) if type(key) in (str, int) else None
        if name is None:
            name = f"{self.label}[{safe_repr(key)}]"
            if type(key) in (str, int):
                self._cache[key] = name
        return name


def guard_result(result: Any, loss_key: Any, labels: Labels, check: LossCheck | None) -> Any:
    """verl style: check ``result[loss_key]`` and publish every other element (nothing in ``off``)."""
    mode = resolve(None)
    if mode == OFF:
        return result
    if isinstance(result, (tuple, list)):
        n = len(result)
        if type(loss_key) is not int or not -n <= loss_key < n:
            raise GradGuardError(f"{labels.label} returned {n} elements; loss={loss_key!r} is not an index of them")
        loss_key %= n
        items: list[tuple[Any, Any]] = list(
            enumerate(list(result) if type(result) in (tuple, list) else _items(result))
        )
    elif isinstance(result, Mapping):
        if loss_key not in result:
            raise GradGuardError(f"{labels.label} returned a mapping without the loss key {safe_repr(loss_key)}")
        items = list(dict.items(result) if isinstance(result, dict) else result.items())
    else:  # a bare loss
        if check is not None:
            check(result)
        return result
    if check is not None:
        check(result[loss_key])
    changed = {}
    for key, item in items:
        if key == loss_key and type(key) is type(loss_key):
            continue
        new = publish(item, labels[key], mode)
        if new is not item:
            changed[key] = new
    return with_items(result, changed) if changed else result


def _items(result: Any) -> list[Any]:
    """A sequence result's items as stored, whatever its ``__iter__`` does."""
    children, context = spec_for(type(result)).flatten(result)
    return children[: len(spec_for(type(result)).item_keys(context))]  # type: ignore[misc]


def with_items(result: Any, changed: dict[Any, Any]) -> Any:
    """A copy of ``result`` of the same type with the items at ``changed``'s keys replaced."""
    if type(result) is tuple or type(result) is list:
        out = list(result)
        for key, value in changed.items():
            out[key] = value
        return tuple(out) if type(result) is tuple else out
    if type(result) is dict:
        return {**result, **changed}
    spec = spec_for(type(result))
    if spec.item_keys is not None:
        children, context = spec.flatten(result)
        index = {key: i for i, key in enumerate(spec.item_keys(context))}
        children = list(children)
        for key, value in changed.items():
            children[index[key]] = value
        return spec.unflatten(children, context)
    # A mapping whose items are not its structure (a user MutableMapping): rebuild it with the
    # changed item objects replaced wherever it holds them.
    return substitute(result, {id(result[key]): (result[key], value) for key, value in changed.items()})


def guard_loss_func(
    loss_func: Callable[..., Any], labels: Labels | None, check: LossCheck | None
) -> Callable[..., Any]:
    """Megatron style: ``loss_func`` wrapped so its loss stays live and checked and the rest is published.

    ``loss_func(output, non_loss_data=True)`` (Megatron's ``collect_non_loss_data``) returns data,
    not a loss: all of it is published, unchecked. With ``labels=None`` nothing is published, only
    the loss checked: the engine adapter guards the store the report goes to instead. A function
    already wrapped so is returned as it is.
    """
    if getattr(loss_func, "__gradguard_loss_func__", False):
        return loss_func

    def guarded_loss_func(*args: Any, **kwargs: Any) -> Any:
        out = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data"):
            return out if labels is None else publish(out, labels.label)
        if isinstance(out, (tuple, list)) and len(out) >= 2:
            if labels is None:
                if check is not None:
                    check(out[0])
                return out
            return guard_result(out, 0, labels, check)
        return out

    guarded_loss_func.__wrapped__ = loss_func  # type: ignore[attr-defined]
    guarded_loss_func.__gradguard_loss_func__ = True  # type: ignore[attr-defined]
    return guarded_loss_func
