"""``LossCheck``, the configured loss check ``@forward_step`` and the adapters hold, and the loss
contract under ``torch.func`` transforms.

Guarded against: a ``params=`` generator used up by the first walk; an adapter's option not named
in its error, and ``params=`` silently ignored; a false ``LossContractError`` from
``torch.func.jvp``/``vmap`` over a ``@forward_step`` function.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad

import gradguard
from gradguard import GradGuardError, LossContractError, LossContractWarning
from gradguard._guards.contract import LossCheck

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's


class PolicyValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Linear(4, 4)
        self.value_head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value_head(self.policy(x))

    def loss(self, x: torch.Tensor, *, trap: bool = False) -> torch.Tensor:
        out = self.policy(x)
        if trap:
            out = out.detach()  # the trap: the policy gets zero gradient
        return self.value_head(out).mean()  # still requires grad through the value head


@pytest.fixture
def model() -> PolicyValue:
    return PolicyValue()


X = torch.randn(2, 4)


# --------------------------------------------------------------------------------------------------
# params= is read once, at construction; a module is re-read at every walk
# --------------------------------------------------------------------------------------------------


def test_params_generator_is_read_once_not_used_up(model: PolicyValue) -> None:
    check = LossCheck("reaches_params", model.policy.parameters())  # a one-shot generator
    check(model.loss(X))
    for _ in range(3):  # every later walk still checks both parameters
        with pytest.raises(LossContractError, match=r"param\[0\], param\[1\]"):
            check(model.loss(X, trap=True))


def test_named_parameters_generator_is_read_once(model: PolicyValue) -> None:
    check = LossCheck("reaches_params", model.policy.named_parameters())
    check(model.loss(X))
    with pytest.raises(LossContractError, match=r"weight, bias"):
        check(model.loss(X, trap=True))
    with pytest.raises(LossContractError, match=r"weight, bias"):
        check(model.loss(X, trap=True))


def test_bad_params_are_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"params\[1\] is a str; accepted: a parameter tensor or a \(name, parameter\)"):
        LossCheck("reaches_params", [nn.Parameter(torch.ones(1)), "bias"])


def test_a_module_is_reread_so_later_parameters_are_seen(model: PolicyValue) -> None:
    check = LossCheck("reaches_params", model)
    check(model.loss(X))
    model.extra = nn.Linear(4, 4)  # added after construction, never used by the loss
    with pytest.raises(LossContractError, match=r"extra\.weight, extra\.bias"):
        check(model.loss(X))
    del model.extra
    model.policy = nn.Linear(4, 4)  # replaced (as fully_shard or PEFT do): the new one is checked
    check(model.loss(X))
    with pytest.raises(LossContractError, match=r"policy\.weight, policy\.bias"):
        check(model.loss(X, trap=True))


def test_a_list_is_read_once_as_documented(model: PolicyValue) -> None:
    params = [model.policy.weight]
    check = LossCheck("reaches_params", params)
    params.append(nn.Parameter(torch.ones(1)))  # not seen: read at construction
    check(model.loss(X))


def test_check_every_walks_every_nth_call_and_checks_requires_grad_between(model: PolicyValue) -> None:
    check = LossCheck("reaches_params", model.policy.parameters(), check_every=2)
    outcomes = []
    for _ in range(4):
        try:
            check(model.loss(X, trap=True))
            outcomes.append("passed")
        except LossContractError:
            outcomes.append("error")
    assert outcomes == ["error", "passed", "error", "passed"]
    with pytest.raises(LossContractError, match="does not require grad"):
        check(model.loss(X).detach())  # a call between walks


# --------------------------------------------------------------------------------------------------
# options are validated; the error names the option the user set
# --------------------------------------------------------------------------------------------------


def test_refused_on_violation_names_the_users_option() -> None:
    with pytest.raises(
        GradGuardError, match=r"^on_violation='strict' is not accepted; accepted: 'raise', 'warn', 'off'$"
    ):
        LossCheck(on_violation="strict")
    with pytest.raises(GradGuardError, match=r"^loss_check='strict' is not accepted") as info:
        LossCheck(on_violation="strict", on_violation_option="loss_check")
    assert "on_violation" not in str(info.value)


@pytest.mark.parametrize("check", ["requires_grad", None])
def test_params_without_reaches_params_is_refused(check: Any, model: PolicyValue) -> None:
    with pytest.raises(GradGuardError, match=r"params= is read only by check='reaches_params'"):
        LossCheck(check, model)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"check": "bogus"}, "check='bogus' is not accepted"),
        ({"check": "reaches_params"}, "needs params="),
        ({"check_every": 0}, "check_every=0 is not accepted; accepted: a whole number >= 1"),
        ({"check_every": True}, "check_every=True is not accepted; accepted: a whole number >= 1"),
    ],
)
def test_bad_options_are_clear_errors(options: dict[str, Any], match: str) -> None:
    with pytest.raises(GradGuardError, match=match):
        LossCheck(**options)


# --------------------------------------------------------------------------------------------------
# on_violation, and the one test that lets a loss requiring grad pass without a walk
# --------------------------------------------------------------------------------------------------


def test_on_violation_raise_warn_off(model: PolicyValue) -> None:
    detached = model.loss(X).detach()
    with pytest.raises(LossContractError, match="my loss does not require grad"):
        LossCheck(name="my loss")(detached)
    with pytest.warns(LossContractWarning, match="my loss does not require grad"):
        LossCheck(on_violation="warn", name="my loss")(detached)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossCheck(on_violation="off")(detached)
        LossCheck(None)(detached)


def test_a_loss_requiring_grad_passes_without_a_walk(model: PolicyValue, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradguard._guards import contract as _contract

    check = LossCheck("reaches_params", model, check_every=2)
    check(model.loss(X))  # walks
    monkeypatch.setattr(_contract, "_verdict", lambda *a: pytest.fail("the requires_grad pass took the slow path"))
    check(model.loss(X))  # between walks: decided by requires_grad alone
    LossCheck()(model.loss(X))


@pytest.mark.parametrize("value", [1.5, None, "loss", {"loss": 1.0}])
def test_non_tensor_losses_pass(value: Any) -> None:
    LossCheck()(value)


def test_no_grad_is_not_checked(model: PolicyValue) -> None:
    with torch.no_grad():
        LossCheck("reaches_params", model)(model.loss(X))


# --------------------------------------------------------------------------------------------------
# torch.func transforms and forward-mode AD
# --------------------------------------------------------------------------------------------------


@gradguard.forward_step
def scaled(w: torch.Tensor, x: torch.Tensor) -> Any:
    y = w * x
    return y.sum(), {"y": y}


@gradguard.forward_step
def detached(w: torch.Tensor, x: torch.Tensor) -> Any:
    y = w * x
    return y.sum().detach(), {"y": y}


W, XS = torch.randn(3), torch.randn(3)


def test_jvp_and_vmap_over_forward_step_are_not_false_errors() -> None:
    primal, tangent = torch.func.jvp(lambda w: scaled(w, XS)[0], (W,), (torch.ones(3),))
    assert torch.equal(tangent, XS.sum())
    assert torch.equal(torch.func.vmap(lambda w: scaled(w, XS)[0])(torch.ones(2, 3)), XS.sum().expand(2))
    torch.func.jacfwd(lambda w: scaled(w, XS)[0])(W)
    torch.func.vmap(torch.func.jvp, in_dims=(None, 0, 0))(
        lambda w: scaled(w, XS)[0], (torch.ones(2, 3),), (torch.ones(2, 3),)
    )


def test_grad_over_forward_step_still_checks() -> None:
    assert torch.equal(torch.func.grad(lambda w: scaled(w, XS)[0])(W), XS)
    assert torch.equal(torch.func.vmap(torch.func.grad(lambda w: scaled(w, XS)[0]))(torch.ones(2, 3)), XS.expand(2, 3))
    # a detached loss inside torch.func.grad is a real bug: grad returns zeros, silently
    assert torch.equal(torch.func.grad(lambda w: (w * XS).sum().detach())(W), torch.zeros(3))
    with pytest.raises(LossContractError, match="does not require grad"):
        torch.func.grad(lambda w: detached(w, XS)[0])(W)


def test_plain_eager_still_checks() -> None:
    with pytest.raises(LossContractError, match="does not require grad"):
        detached(W.clone().requires_grad_(), XS)
    with pytest.raises(LossContractError, match="does not require grad"):
        gradguard.check_loss((W * XS).sum())  # grad enabled, nothing requires grad


def test_eager_forward_mode_ad_is_not_checked() -> None:
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(W, torch.ones(3))
        loss, _ = scaled(dual, XS)
        assert not loss.requires_grad and forward_ad.unpack_dual(loss).tangent is not None
        with pytest.raises(LossContractError, match="does not require grad"):
            gradguard.check_loss(loss.detach())  # no tangent: not forward-mode, an error as ever


def test_reaches_params_under_a_transform_cannot_decide_and_says_so(model: PolicyValue) -> None:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (X,))
        return gradguard.check_loss(out.mean(), params=model)

    with pytest.warns(LossContractWarning, match=r"cannot decide.*torch\.func transform \(Grad\)"):
        grads = torch.func.grad(loss)(params)
    assert set(grads) == set(params)


# --------------------------------------------------------------------------------------------------
# Through @forward_step
# --------------------------------------------------------------------------------------------------


def test_forward_step_reads_a_params_generator_once(model: PolicyValue) -> None:
    @gradguard.forward_step(check="reaches_params", params=model.policy.parameters())
    def fs(x: torch.Tensor, trap: bool) -> Any:
        loss = model.loss(x, trap=trap)
        return loss, {"loss": loss.detach()}

    fs(X, False)
    for _ in range(2):  # the second and later walks must not pass vacuously
        with pytest.raises(LossContractError, match=r"param\[0\], param\[1\]"):
            fs(X, True)


def test_forward_step_refuses_params_it_would_ignore(model: PolicyValue) -> None:
    for check in (None, "requires_grad"):
        with pytest.raises(GradGuardError, match=r"params= is read only by check='reaches_params'"):
            gradguard.forward_step(check=check, params=model)
    gradguard.forward_step(params=model)  # left out, the check is the one params= is for
