"""Whose state an object on a path is: the program's own, or a library's.

The watch repairs only the program's own state, and the audit suggests a fix only where the user can
apply one. One rule: an object belongs to the package its class is defined in — the standard
library, torch, an installed package (a module under a ``site-packages`` directory) — or to the
program; a module global belongs to its module's owner. Plain containers (``list``, ``dict``,
``deque`` and their subclasses, ``SimpleNamespace``) and torch's own ``nn.Module`` classes
(``nn.Linear``, ``nn.Sequential``: the blocks a program builds its model from) belong to whoever holds
them. Along a path, ownership is that of the nearest object above that is neither: a ``list`` in a
user's object is the user's, in ``logging.Handler`` the standard library's, in a torchmetrics
``Metric`` (an ``nn.Module`` a package defines) torchmetrics'.
"""

from __future__ import annotations

import collections
import types
from typing import Any

from torch import nn

from .installed import library_of_module
from .paths import Path, class_dict, frame_qualname, is_a, module_dict

__all__ = ["Owner", "library", "path_owners"]

_QUALNAME = type.__dict__["__qualname__"].__get__
_CONTAINERS = (list, dict, tuple, set, frozenset, collections.deque, types.SimpleNamespace)


def library(obj: Any) -> str | None:
    """The library that owns ``obj``'s state (see the module documentation), or ``None``: the
    program's own, or a container whose owner is whoever holds it."""
    if is_a(obj, _CONTAINERS) or _torch_module(obj):
        return None
    if is_a(obj, types.ModuleType):
        name = module_dict(obj).get("__name__")
        return library_of_module(name) if isinstance(name, str) else None
    cls = obj if is_a(obj, type) else type(obj)
    module = class_dict(cls).get("__module__")
    return library_of_module(module) if isinstance(module, str) else None


def _torch_module(obj: Any) -> bool:
    """An ``nn.Module`` of one of torch's own classes: a block of the program's model."""
    if not is_a(obj, nn.Module):
        return False
    module = class_dict(type(obj)).get("__module__")
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


class Owner:
    """Who owns each object along a path: :func:`path_owners`."""

    __slots__ = ("label", "what")

    def __init__(self, label: str | None, what: str) -> None:
        self.label, self.what = label, what

    @property
    def program(self) -> bool:
        return self.label is None

    def __repr__(self) -> str:
        return f"Owner({self.label!r}, {self.what!r})"


def path_owners(path: Path) -> list[Owner]:
    """For each edge of ``path`` (root first), who owns the state it reads (``edge.owner``): a
    library, with what its object is (``logging.BufferingHandler``), or the program."""
    owners: list[Owner] = []
    current = Owner(None, "")
    for edge in path:
        obj = edge.owner
        if edge.kind == "local":
            code = obj.f_code if is_a(obj, types.FrameType) else None
            module = obj.f_globals.get("__name__") if code is not None else None
            label = library_of_module(module) if isinstance(module, str) else None
            current = Owner(label, f"a local of {frame_qualname(obj) if code is not None else '?'}")
        elif edge.kind == "named":  # gradguard._heap.roots: an object of the program a framework holds
            current = Owner(None, obj.label)
        elif edge.kind == "cell":
            label = library_of_module(obj.__module__) if isinstance(getattr(obj, "__module__", None), str) else None
            current = Owner(label, f"a closure of {obj.__qualname__}")
        elif not is_a(obj, _CONTAINERS):
            label = library(obj)
            cls = obj if is_a(obj, (type, types.ModuleType)) else type(obj)
            name = module_dict(obj).get("__name__", "?") if is_a(obj, types.ModuleType) else _qualified(cls)
            if label is not None or is_a(obj, nn.Module) or edge.kind in ("global", "class", "attr", "slot"):
                current = Owner(label, name)
        owners.append(current)
    return owners


def _qualified(cls: type) -> str:
    module, qualname = class_dict(cls).get("__module__"), _QUALNAME(cls)
    return f"{module}.{qualname}" if isinstance(module, str) and module != "builtins" else str(qualname)
