"""A frame's local variables, read without writing anything.

Before Python 3.13, ``frame.f_locals`` of a function frame is not a view: reading it copies the fast
locals into a snapshot dict that the frame keeps (the same dict ``locals()`` returns in that
frame). Reading it therefore *writes* the user's ``hparams = locals()`` dict, and the snapshot then
pins whatever it copied (say, this step's loss) until the frame exits. :func:`frame_locals` reads
the fast locals themselves instead:

* Python 3.13 and later (PEP 667): ``frame.f_locals`` is a proxy over the fast locals; reading it
  writes nothing.
* Python 3.10 to 3.12: the slots are read through ``ctypes`` at the offsets CPython's frame
  structures have in these versions. The layout is checked once against a frame whose locals are
  known; where it does not match (a debug or otherwise unusual build), :func:`frame_locals` returns
  ``None`` and the frame's locals are not read at all, rather than read with a side effect.

Another thread can run between two bytecodes and leave the frame it runs, after which the memory
the frame used is reused: each read here is one expression with no call in between the moment the
frame's memory is located and the moment its slots are read (CPython only switches threads at
calls and backward jumps), with the cyclic garbage collector paused so that no finalizer runs in
the middle. The objects read are new references: they stay valid whatever the frame does next.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import operator
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["frame_locals", "readable"]

_P = ctypes.c_void_p
_PROXY = sys.version_info >= (3, 13)
_HEAD: list[tuple[str, Any]] = [("ob_refcnt", ctypes.c_ssize_t), ("ob_type", _P)]


def _interpreter_frame_fields() -> list[tuple[str, Any]]:
    """``_PyInterpreterFrame`` (Include/internal/pycore_frame.h) up to ``localsplus``: 3.11 and 3.12."""
    if sys.version_info[:2] == (3, 11):
        return [
            ("f_func", _P), ("f_globals", _P), ("f_builtins", _P), ("f_locals", _P), ("f_code", _P),
            ("frame_obj", _P), ("previous", _P), ("prev_instr", _P), ("stacktop", ctypes.c_int),
            ("is_entry", ctypes.c_bool), ("owner", ctypes.c_char),
        ]  # fmt: skip
    return [
        ("f_code", _P), ("previous", _P), ("f_funcobj", _P), ("f_globals", _P), ("f_builtins", _P),
        ("f_locals", _P), ("frame_obj", _P), ("prev_instr", _P), ("stacktop", ctypes.c_int),
        ("return_offset", ctypes.c_uint16), ("owner", ctypes.c_char),
    ]  # fmt: skip


@functools.lru_cache(maxsize=256)
def _layout(slots: int) -> Any:
    """The ``ctypes`` view of a frame object with ``slots`` local slots.

    3.11/3.12: the frame object points (``f_frame``) to the interpreter frame, whose ``localsplus``
    array holds the slots. 3.10: the frame object holds ``f_localsplus`` itself, ending the struct.
    """
    if sys.version_info < (3, 11):
        fields = [*_HEAD, ("ob_size", ctypes.c_ssize_t), ("f_back", _P), ("f_code", _P)]
        start = type(sys._getframe()).__basicsize__ - ctypes.sizeof(_P)
        pad = start - ctypes.sizeof(type("Head", (ctypes.Structure,), {"_fields_": fields}))
        fields += [("_rest", ctypes.c_char * pad), ("slots", _slot_union(slots))]
        return type("Frame", (ctypes.Structure,), {"_fields_": fields})
    interp = type(
        "InterpreterFrame",
        (ctypes.Structure,),
        {"_fields_": [*_interpreter_frame_fields(), ("slots", _slot_union(slots))]},
    )
    return type(
        "Frame", (ctypes.Structure,), {"_fields_": [*_HEAD, ("f_back", _P), ("f_frame", ctypes.POINTER(interp))]}
    )


def _slot_union(slots: int) -> type:
    """The slot array read two ways: as addresses (``NULL`` is ``None``) and as objects (new references)."""
    return type("Slots", (ctypes.Union,), {"_fields_": [("ids", _P * slots), ("objects", ctypes.py_object * slots)]})


@contextmanager
def _collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _slot_names(code: types.CodeType) -> list[str]:
    """The names of ``code``'s local slots, in order: variables, cell variables, free variables.

    3.11+: a parameter that is also a cell variable has one slot (among the parameters); 3.10 gives
    it a local slot (emptied when the frame starts) and a cell slot.
    """
    names = list(code.co_varnames)
    if sys.version_info >= (3, 11):
        cells = [name for name in code.co_cellvars if name not in names]
    else:
        cells = list(code.co_cellvars)
    return names + cells + list(code.co_freevars)


def _raw(frame: types.FrameType) -> list[tuple[str, Any]]:
    code = frame.f_code
    names = _slot_names(code)
    if not names:
        return []
    outer = _layout(len(names))
    fid, cid = id(frame), id(code)
    with _collector_paused():
        # One expression each: nothing between locating the slots and reading them can switch threads.
        if sys.version_info < (3, 11):
            view = outer.from_address(fid)
            ids, same = view.slots.ids[:], view.f_code == cid
        else:
            view = outer.from_address(fid).f_frame.contents
            ids, same, owner = view.slots.ids[:], view.f_code == cid and view.frame_obj == fid, view.frame_obj
            # a finished frame's data was moved into the frame object, which no longer points back to it
            same = same or (not owner and fid < ctypes.addressof(view) < fid + sys.getsizeof(frame))
        if not same:
            raise _LayoutError
        present = [i for i, address in enumerate(ids) if address]
        if not present:
            return []
        getter = operator.itemgetter(*present)
        if sys.version_info < (3, 11):
            values = getter(outer.from_address(fid).slots.objects)
        else:
            values = getter(outer.from_address(fid).f_frame.contents.slots.objects)
    if len(present) == 1:
        values = (values,)
    return [(names[i], v) for i, v in zip(present, values)]


class _LayoutError(Exception):
    """The frame structures are not laid out as this module expects."""


def _check_layout() -> bool:
    """Whether the raw reader reads a known frame right (once per process)."""

    def probe(a: object, b: object) -> list[tuple[str, Any]]:
        c = [a]

        def inner() -> object:
            return c

        d = inner  # noqa: F841 - a local the probe must find
        return _raw(sys._getframe())

    a, b = object(), object()
    try:
        seen = dict(probe(a, b))
    except (_LayoutError, ValueError, OSError):
        return False
    cell = seen.get("c")
    return (
        seen.get("a") is a
        and seen.get("b") is b
        and isinstance(cell, types.CellType)
        and cell.cell_contents[0] is a
        and "d" in seen
    )


@functools.lru_cache(maxsize=1)
def readable() -> bool:
    """Whether frame locals can be read without side effects on this interpreter."""
    return _PROXY or _check_layout()


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]] | None:
    """``(name, value)`` for each bound local of ``frame`` (cell and free variables dereferenced),
    read without writing anything into the frame or its ``locals()`` snapshot; ``None`` when this
    interpreter's frames cannot be read that way.

    A module or class body's locals are its namespace dict, which reading never changes.
    """
    code = frame.f_code
    if _PROXY or not code.co_flags & 0x0001:  # inspect.CO_OPTIMIZED: else f_locals is the real namespace
        try:
            return list(frame.f_locals.items())
        except RuntimeError:  # a dict changed by another thread while it was read: try once more
            return list(frame.f_locals.items())
    if not readable():
        return None
    try:
        pairs = _raw(frame)
    except ValueError:  # a slot emptied between the two reads (another thread deleted a local): once more
        try:
            pairs = _raw(frame)
        except ValueError:
            return None
    except _LayoutError:
        return None
    cells = {*code.co_cellvars, *code.co_freevars}
    out = []
    for name, value in pairs:
        if name in cells and type(value) is types.CellType:
            try:
                value = value.cell_contents
            except ValueError:  # an empty cell: the variable is unbound
                continue
        out.append((name, value))
    return out
