"""The one checker of option values: a flag or a variable reads as the Python value does, anything else
is refused naming the option as spelled, the value and what is accepted, and nothing here needs torch."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import env
from hypothesis import given
from hypothesis import strategies as st

from gradguard._errors import GradGuardError
from gradguard._policy import validate


@given(st.integers(min_value=1, max_value=10**30))
def test_every_reads_a_number_and_its_digits_alike(n: int) -> None:
    assert validate.every(n) == validate.every(str(n)) == validate.every(f"  {n} ") == n


@pytest.mark.parametrize("value", [0, -1, True, 1.0, "1.5", "+2", "-1", "²", "٣", "", "  ", "often", None, [1]])
def test_every_refuses_anything_else_naming_the_option_as_spelled(value: object) -> None:
    with pytest.raises(GradGuardError) as info:
        validate.every(value, what="--gradguard-audit")
    said = str(info.value)
    assert said.startswith(f"--gradguard-audit={value!r}") and f"; accepted: {validate.EVERY_ACCEPTED}" in said
    assert ("(an empty value)" in said) == (isinstance(value, str) and not value.strip())


@pytest.mark.parametrize(
    ("value", "read"),
    [("auto", "auto"), (" AUTO ", "auto"), (3, 3), ("3", 3), (0, None), ("0", None), ("Off", None), ("none", None),
     (None, None), ("false", None), ("no", None)],
)  # fmt: skip
def test_an_audit_setting_is_every_or_no_watch(value: object, read: object) -> None:
    assert validate.audit(value) == read


def test_an_audit_setting_that_is_neither_names_both_what_every_takes_and_off() -> None:
    with pytest.raises(GradGuardError, match=r"^GRADGUARD_AUDIT='sometimes' is not accepted; accepted: a positive"):
        validate.audit("sometimes", what="GRADGUARD_AUDIT")
    with pytest.raises(GradGuardError, match=r"or 0/off \(no watch\)$"):
        validate.audit(-1)


def test_a_keyword_that_keeps_its_value_as_given_takes_no_text() -> None:
    """``TriggerSettings(floor="5")`` would keep the string: refused, not read as 5."""
    with pytest.raises(GradGuardError, match=r"^TriggerSettings\(floor='5'\) is not accepted; accepted: bytes$"):
        validate.whole("5", what="floor", least=1, accepted="bytes", within="TriggerSettings", text=False)
    assert validate.whole(5, what="floor", least=1, text=False) == 5


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf", True, "x", None])
def test_a_number_is_finite_and_real(value: object) -> None:
    with pytest.raises(GradGuardError, match=r"^--memory-cap=.* is not accepted; accepted: a positive number"):
        validate.number(value, what="--memory-cap", accepted="a positive number of GiB", ok=lambda x: x > 0)


def test_a_number_in_range_is_returned_as_given() -> None:
    assert validate.number(1, what="x", accepted="", ok=lambda x: x >= 1) == 1
    assert validate.number(" 0.5 ", what="x", accepted="", ok=lambda x: 0 <= x < 1) == 0.5
    with pytest.raises(GradGuardError, match=r"^x=1 is not accepted; accepted: a number < 1$"):
        validate.number(1, what="x", accepted="a number < 1", ok=lambda x: x < 1)


def test_a_choice_takes_any_case_and_says_what_is_wrong_its_own_way() -> None:
    choices = {"on": True, "1": True, "off": False}
    assert validate.choice(" ON ", choices, what="x", accepted="on/1, off") is True
    with pytest.raises(GradGuardError, match=r"^GRADGUARD='maybe' is not a mode; accepted: on/1, off$"):
        validate.choice("maybe", choices, what="GRADGUARD", accepted="on/1, off", said="is not a mode")
    with pytest.raises(GradGuardError, match=r"^x=1 is not accepted"):
        validate.choice(1, choices, what="x", accepted="on/1, off")  # "1" is taken, the int is not


@pytest.mark.parametrize(("text", "read"), [("7", 7), (" 7 ", 7), ("0", 0), ("-1", None), ("²", None), ("٣", None),
                                            ("", None), (None, None), ("x", None)])  # fmt: skip
def test_a_count_another_program_set_is_read_or_left_out(text: str | None, read: int | None) -> None:
    assert validate.read_count(text) == read


def test_an_output_file_is_checked_before_the_work_that_fills_it(tmp_path: Path) -> None:
    assert validate.output_file(str(tmp_path / "out.json"), what="--json") == str(tmp_path / "out.json")
    refused = {
        " ": "--json=' ' (an empty value) is not accepted; accepted: a file path",
        str(tmp_path / "no" / "out.json"): f"is not accepted (the folder {str(tmp_path / 'no')!r} does not exist)",
        str(tmp_path): "is not accepted (it is a folder)",
    }
    for value, said in refused.items():
        with pytest.raises(GradGuardError) as info:
            validate.output_file(value, what="--json")
        assert said in str(info.value)


def test_the_checker_imports_no_torch() -> None:
    code = "import sys, gradguard._policy.validate, gradguard._policy.modes; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert run.returncode == 0 and run.stdout == "False\n", run.stderr
