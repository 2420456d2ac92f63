"""register_container, and objects no rule knows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import assert_detached_from, grad_tensor, plain_tensor
from _shapes import PytreeBox
from torch import nn

import gradguard
from gradguard import GradGuardError, detach_tree, find_graphs


class UserBox:
    """Taught to gradguard with register_container (by the fixture below)."""

    def __init__(self, x: Any, y: Any, z: Any, label: str = "ubox") -> None:
        self.x, self.y, self.z, self.label = x, y, z, label


@pytest.fixture
def user_box_registered() -> Iterator[None]:
    gradguard.register_container(
        UserBox,
        lambda b: ([b.x, b.y, b.z], b.label),
        lambda children, label: UserBox(*children, label=label),
    )
    try:
        yield
    finally:
        gradguard.unregister_container(UserBox)


# --------------------------------------------------------------------------------------------------
# register_container
# --------------------------------------------------------------------------------------------------


def test_register_container_round_trip(user_box_registered: None) -> None:
    g = grad_tensor()
    p = plain_tensor()
    box = UserBox(g, p, [1], label="lbl")
    out = detach_tree(box)
    assert type(out) is UserBox and out is not box
    assert out.label == "lbl"
    assert_detached_from(out.x, g)
    assert out.y is p and out.z is box.z
    assert box.x is g
    unchanged = UserBox(p, 1, "s")
    assert detach_tree(unchanged) is unchanged
    recs = find_graphs({"b": box})
    assert [r.path for r in recs] == ["['b'][0]"]


def test_register_container_applies_to_subclasses(user_box_registered: None) -> None:
    class SubBox(UserBox):
        pass

    g = grad_tensor()
    out = detach_tree(SubBox(g, 1, 2))
    # the registered unflatten decides the type it rebuilds
    assert isinstance(out, UserBox)
    assert_detached_from(out.x, g)


def test_unregister_container_restores_pass_through() -> None:
    g = grad_tensor()
    box = UserBox(g, 1, 2)
    assert detach_tree(box) is box  # unknown: passes through untouched
    gradguard.register_container(UserBox, lambda b: ([b.x], None), lambda c, _: UserBox(c[0], 1, 2))
    try:
        assert not detach_tree(box).x.requires_grad
    finally:
        gradguard.unregister_container(UserBox)
    assert detach_tree(box) is box  # the cached spec was dropped
    assert box.x is g
    with pytest.raises(KeyError):
        gradguard.unregister_container(UserBox)


def test_register_container_takes_precedence_over_pytree() -> None:
    g = grad_tensor()
    box = PytreeBox(g, 2, 3, label="orig")
    gradguard.register_container(
        PytreeBox, lambda b: ([b.x], b.label), lambda c, label: PytreeBox(c[0], "via", "gradguard", label)
    )
    try:
        out = detach_tree(box)
        assert (out.y, out.z, out.label) == ("via", "gradguard", "orig")
    finally:
        gradguard.unregister_container(PytreeBox)
    out = detach_tree(box)
    assert (out.y, out.z, out.label) == (2, 3, "orig")


@pytest.mark.parametrize("not_a_class", [UserBox(1, 2, 3), "UserBox", lambda: None, 3])
def test_register_container_rejects_non_class(not_a_class: Any) -> None:
    with pytest.raises(TypeError):
        gradguard.register_container(not_a_class, lambda o: ([], None), lambda c, x: None)


@pytest.mark.parametrize("native", [dict, list, tuple, torch.Tensor, nn.Parameter, int, str])
def test_register_container_rejects_native_types(native: type) -> None:
    with pytest.raises(GradGuardError):
        gradguard.register_container(native, lambda o: ([], None), lambda c, x: None)
    # nothing got registered, so the native handling is intact
    g = grad_tensor()
    assert not detach_tree({"a": [g]})["a"][0].requires_grad
    with pytest.raises(KeyError):
        gradguard.unregister_container(native)


@pytest.mark.parametrize("which", ["flatten", "unflatten"])
def test_register_container_rejects_non_callable(which: str) -> None:
    fns: dict[str, Any] = {"flatten": lambda o: ([], None), "unflatten": lambda c, x: None}
    fns[which] = "not callable"
    with pytest.raises(TypeError, match=which):
        gradguard.register_container(UserBox, fns["flatten"], fns["unflatten"])
    box = UserBox(grad_tensor(), 1, 2)
    assert detach_tree(box) is box  # not registered
    with pytest.raises(KeyError):
        gradguard.unregister_container(UserBox)


def test_register_container_bad_flatten_result() -> None:
    class Odd:
        pass

    gradguard.register_container(Odd, lambda o: 5, lambda c, x: Odd())
    try:
        with pytest.raises(GradGuardError, match="flatten"):
            detach_tree(Odd())
    finally:
        gradguard.unregister_container(Odd)


def test_gradguard_error_is_runtime_error() -> None:
    assert issubclass(GradGuardError, RuntimeError)


# --------------------------------------------------------------------------------------------------
# unknown objects
# --------------------------------------------------------------------------------------------------


class Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_unknown_objects_pass_through_untouched() -> None:
    g = grad_tensor()
    o = Opaque(g)
    assert detach_tree(o) is o
    assert o.t is g
    s = {1, 2}
    f = frozenset({"a"})
    rec = [o, s, f, g, object]
    out = detach_tree(rec)
    assert out[0] is o and out[1] is s and out[2] is f and out[4] is object
    assert_detached_from(out[3], g)
    assert o.t is g and o.t.requires_grad
