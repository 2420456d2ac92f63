"""The tree walk on a torch without ``torch.utils._pytree``'s tuple-kind predicates (before 2.8): the
same containers are taken apart and rebuilt, with gradguard's own tests of what a namedtuple and a
structseq are (``gradguard._compat``)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import typing

import pytest
import torch
from torch.utils import _pytree

from gradguard import _compat


class Point(typing.NamedTuple):
    x: object
    y: object


CLASSES = [
    tuple,
    list,
    Point,
    collections.namedtuple("Pair", "a b"),
    type(torch.max(torch.ones(2, 2), dim=0)),  # torch.return_types.max, a structseq
    os.stat_result,
    type("TupleChild", (tuple,), {}),
    dict,
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_the_fallback_predicates_agree_with_torchs(cls: type) -> None:
    assert _compat._is_namedtuple_class(cls) == (cls in (Point, CLASSES[3]))
    assert _compat._is_structseq_class(cls) == (cls in (CLASSES[4], os.stat_result))
    if hasattr(_pytree, "is_structseq_class"):
        assert _compat._is_structseq_class(cls) == _pytree.is_structseq_class(cls)
        assert _compat._is_namedtuple_class(cls) == _pytree.is_namedtuple_class(cls)


SCRIPT = textwrap.dedent(
    """
    import collections, dataclasses, typing
    import torch
    from torch.utils import _pytree
    for name in ("is_structseq_class", "is_namedtuple_class"):  # as on torch 2.4 to 2.7
        if hasattr(_pytree, name):
            delattr(_pytree, name)
    import gradguard

    class Point(typing.NamedTuple):
        x: object
        y: object

    @dataclasses.dataclass
    class Record:
        loss: object

    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    store = gradguard.guard([], name="records")
    store.append({"a": (loss, 2)})
    store.append(Point(loss, 1))
    store.append(Record(loss))
    store.append(collections.deque([loss], maxlen=4))
    store.append(torch.max(x * 2, dim=0))
    assert store[0]["a"][0].grad_fn is None and store[0]["a"][1] == 2
    assert type(store[1]) is Point and store[1].x.grad_fn is None
    assert type(store[2]) is Record and store[2].loss.grad_fn is None
    assert store[3].maxlen == 4 and store[3][0].grad_fn is None
    assert type(store[4]).__name__ == "max" and store[4].values.grad_fn is None
    print("ok")
    """
)


def test_guard_works_without_torchs_tuple_predicates(tmp_path) -> None:
    script = tmp_path / "no_predicates.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
