"""``@gradguard.forward_step`` on each result shape: verl style ``(loss, output, ...)``, lists,
namedtuples and mappings; Megatron style ``(output_tensor, loss_func)``."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from _models import MODEL, assert_published, megatron_forward_step, outputs, verl_result

import gradguard
from gradguard import (
    GradGuardError,
    GraphRetentionError,
    LossContractError,
)

# --------------------------------------------------------------------------------------------------
# verl style results
# --------------------------------------------------------------------------------------------------


def test_verl_loss_stays_live_output_is_detached() -> None:
    captured: list[Any] = []

    @gradguard.forward_step
    def fs(micro_batch: Any, loss_function: Any, forward_only: bool = False) -> Any:
        captured.append(verl_result())
        return captured[-1]

    result = fs(None, None)
    original = captured[0]
    assert type(result) is tuple and len(result) == 2
    assert result is not original
    assert result[0] is original[0]  # the very loss object
    assert result[0].grad_fn is not None
    assert_published(result[1], original[1])
    result[0].backward()  # still trains
    assert MODEL.policy.weight.grad is not None
    MODEL.zero_grad(set_to_none=True)


def test_verl_result_without_graphs_is_returned_as_is() -> None:
    loss, output = verl_result()
    clean = (loss, {"model_output": {"log_probs": output["model_output"]["log_probs"].detach()}, "n": 1})

    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        return clean

    assert fs(None) is clean
    as_list = [loss, {"x": 1}]
    assert gradguard.forward_step(lambda mb: as_list)(None) is as_list


def test_verl_list_result_stays_a_list() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        return list(verl_result())

    result = fs(None)
    assert type(result) is list
    assert result[0].grad_fn is not None
    assert result[1]["model_output"]["log_probs"].grad_fn is None


def test_verl_extra_elements_are_published() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        loss, output = verl_result()
        return loss, output, output["model_output"]["log_probs"] * 2

    loss, output, extra = fs(None)
    assert loss.grad_fn is not None
    assert output["model_output"]["log_probs"].grad_fn is None
    assert extra.grad_fn is None


def test_verl_detached_loss_in_training_raises() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any, loss_function: Any, forward_only: bool = False) -> Any:
        return verl_result(detach_loss=True)

    with pytest.raises(LossContractError, match="does not require grad"):
        fs(None, None)
    with pytest.raises(LossContractError):
        fs(None, None, False)
    with pytest.raises(LossContractError):
        fs(None, None, forward_only=False)


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_verl_forward_only_is_not_checked_and_still_published(how: str) -> None:
    captured: list[Any] = []

    @gradguard.forward_step
    def fs(micro_batch: Any, loss_function: Any, forward_only: bool = False) -> Any:
        captured.append(verl_result(detach_loss=True))
        return captured[-1]

    result = fs(None, None, True) if how == "positional" else fs(None, None, forward_only=True)
    assert result[0] is captured[0][0]
    assert_published(result[1], captured[0][1])


def test_forward_only_default_from_signature_and_custom_name() -> None:
    @gradguard.forward_step
    def eval_step(micro_batch: Any, forward_only: bool = True) -> Any:
        return verl_result(detach_loss=True)

    eval_step(None)  # the signature's default says forward-only: not checked
    with pytest.raises(LossContractError):
        eval_step(None, False)

    @gradguard.forward_step(forward_only="no_grad_pass")
    def fs(micro_batch: Any, no_grad_pass: bool = False, forward_only: bool = False) -> Any:
        return verl_result(detach_loss=True)

    fs(None, True)
    fs(None, no_grad_pass=True)
    with pytest.raises(LossContractError):
        fs(None, forward_only=True)  # not the argument this decorator was told to read

    @gradguard.forward_step(forward_only=None)
    def always(micro_batch: Any, forward_only: bool = False) -> Any:
        return verl_result(detach_loss=True)

    with pytest.raises(LossContractError):
        always(None, forward_only=True)


def test_forward_only_passed_through_kwargs_only() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any, **kwargs: Any) -> Any:
        return verl_result(detach_loss=True)

    fs(None, forward_only=True)
    with pytest.raises(LossContractError):
        fs(None)


def test_grad_disabled_is_not_checked() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any, forward_only: bool = False) -> Any:
        return verl_result()

    with torch.no_grad():
        loss, out = fs(None)
    assert not loss.requires_grad
    assert out["model_output"]["log_probs"].grad_fn is None


def test_loss_key_for_dict_results() -> None:
    captured: list[Any] = []

    @gradguard.forward_step(loss="loss")
    def fs(micro_batch: Any, detach: bool = False) -> Any:
        loss, output = verl_result(detach_loss=detach)
        captured.append({"loss": loss, **output["model_output"], "step": 3})
        return captured[-1]

    result = fs(None)
    original = captured[-1]
    assert type(result) is dict and result is not original
    assert result["loss"] is original["loss"] and result["loss"].grad_fn is not None
    assert result["log_probs"].grad_fn is None and result["entropy"].grad_fn is None
    assert result["step"] == 3
    assert list(result) == list(original)  # key order kept
    assert original["log_probs"].grad_fn is not None  # not mutated
    with pytest.raises(LossContractError):
        fs(None, detach=True)


def test_dict_subclass_result_keeps_its_type() -> None:
    @gradguard.forward_step(loss="loss")
    def fs(micro_batch: Any) -> Any:
        loss, output = verl_result()
        return collections.OrderedDict(loss=loss, log_probs=output["model_output"]["log_probs"])

    result = fs(None)
    assert type(result) is collections.OrderedDict
    assert result["loss"].grad_fn is not None and result["log_probs"].grad_fn is None


def test_loss_index_one() -> None:
    captured: list[Any] = []

    @gradguard.forward_step(loss=1)
    def fs(micro_batch: Any, detach: bool = False) -> Any:
        loss, output = verl_result(detach_loss=detach)
        captured.append((output, loss))
        return captured[-1]

    output, loss = fs(None)
    assert loss is captured[-1][1] and loss.grad_fn is not None
    assert_published(output, captured[-1][0])
    with pytest.raises(LossContractError):
        fs(None, detach=True)


def test_missing_loss_key_or_index_is_a_clear_error() -> None:
    @gradguard.forward_step(loss="loss")
    def fs(micro_batch: Any) -> Any:
        return {"not_loss": 1}

    with pytest.raises(GradGuardError, match="without the loss key 'loss'"):
        fs(None)

    @gradguard.forward_step(loss=5)
    def gs(micro_batch: Any) -> Any:
        return verl_result()

    with pytest.raises(GradGuardError, match="returned 2 elements"):
        gs(None)


Result = collections.namedtuple("Result", ["loss", "output", "n_tokens"])


def test_namedtuple_results_keep_their_type() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any) -> Any:
        loss, output = verl_result()
        return Result(loss, output, 7)

    result = fs(None)
    assert type(result) is Result
    assert result.loss.grad_fn is not None
    assert result.output["model_output"]["log_probs"].grad_fn is None
    assert result.n_tokens == 7


def test_bare_loss_result_is_checked() -> None:
    @gradguard.forward_step
    def fs(micro_batch: Any, detach: bool = False) -> Any:
        loss = verl_result()[0]
        return loss.detach() if detach else loss

    loss = fs(None)
    assert loss.grad_fn is not None
    with pytest.raises(LossContractError):
        fs(None, detach=True)


# --------------------------------------------------------------------------------------------------
# Megatron style results
# --------------------------------------------------------------------------------------------------


def test_megatron_output_tensor_untouched_loss_func_wrapped() -> None:
    inner = megatron_forward_step()
    captured: list[Any] = []

    def raw(data_iterator: Any, model: Any) -> Any:
        captured.append(inner(data_iterator, model))
        return captured[-1]

    fs = gradguard.forward_step(raw)
    output_tensor, loss_func = fs(None, None)
    assert output_tensor is captured[0][0]  # Megatron back-propagates it: left alone
    assert output_tensor.grad_fn is not None
    assert loss_func is not captured[0][1]
    assert loss_func.__wrapped__ is captured[0][1]

    loss, report = loss_func(output_tensor)
    assert loss.grad_fn is not None
    assert report["lm loss"].grad_fn is None and report["entropy"].grad_fn is None
    loss.backward()
    assert MODEL.policy.weight.grad is not None
    MODEL.zero_grad(set_to_none=True)


def test_megatron_loss_is_the_same_object() -> None:
    seen: list[Any] = []

    @gradguard.forward_step
    def fs(data_iterator: Any, model: Any) -> Any:
        output_tensor, _ = outputs()

        def loss_func(output: torch.Tensor) -> Any:
            seen.append((output.sum(), {"x": output * 2}))
            return seen[-1]

        return output_tensor, loss_func

    output_tensor, loss_func = fs(None, None)
    loss, report = loss_func(output_tensor)
    assert loss is seen[0][0]
    assert report["x"].grad_fn is None and seen[0][1]["x"].grad_fn is not None


def test_megatron_loss_num_tokens_report() -> None:
    fs = gradguard.forward_step(megatron_forward_step(with_num_tokens=True))
    output_tensor, loss_func = fs(None, None)
    loss, num_tokens, report = loss_func(output_tensor)
    assert loss.grad_fn is not None
    assert num_tokens.item() == 2 and num_tokens.dtype == torch.int
    assert report["lm loss"].grad_fn is None


def test_megatron_list_result_stays_a_list() -> None:
    inner = megatron_forward_step()
    fs = gradguard.forward_step(lambda it, model: list(inner(it, model)))
    result = fs(None, None)
    assert type(result) is list and len(result) == 2
    assert result[0].grad_fn is not None and callable(result[1])


@pytest.mark.parametrize("with_num_tokens", [False, True])
def test_megatron_detached_loss_raises(with_num_tokens: bool) -> None:
    fs = gradguard.forward_step(megatron_forward_step(detach_loss=True, with_num_tokens=with_num_tokens))
    output_tensor, loss_func = fs(None, None)
    with pytest.raises(LossContractError, match="does not require grad"):
        loss_func(output_tensor)
    with torch.no_grad():  # evaluation: not checked
        loss_func(output_tensor)


def test_megatron_non_loss_data_publishes_everything() -> None:
    fs = gradguard.forward_step(megatron_forward_step())
    output_tensor, loss_func = fs(None, None)
    data = loss_func(output_tensor, non_loss_data=True)
    assert data["log_probs"].grad_fn is None and data["value"].grad_fn is None
    with gradguard.enforce(mode="raise", engines="none"):
        with pytest.raises(GraphRetentionError, match=r"\['value'\]"):
            loss_func(output_tensor, non_loss_data=True)
    with gradguard.enforce(mode="off", engines="none"):
        raw = loss_func(output_tensor, non_loss_data=True)
    assert raw["log_probs"] is output_tensor
