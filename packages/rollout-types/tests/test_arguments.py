"""The argument checks both sides share: durations in seconds and the bearer key."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rollout_types import FieldValueError, check_api_key, check_seconds


class CustomError(ValueError):
    """Stands for a caller's own error class."""


class TestCheckSeconds:
    @pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1", None, True])
    def test_not_a_finite_number(self, value: Any) -> None:
        """Non-numbers, bools and non-finite numbers are refused whatever the bound."""
        with pytest.raises(FieldValueError, match="wait_sec must be a finite number") as info:
            check_seconds("wait_sec", value, allow_negative=True)
        assert info.value.field == "wait_sec"

    @pytest.mark.parametrize(
        ("value", "options", "message"),
        [
            (0, {}, "must be > 0 seconds; got 0"),
            (-1.5, {}, "must be > 0 seconds; got -1.5"),
            (-0.1, {"allow_zero": True}, "must be >= 0 seconds; got -0.1"),
        ],
    )
    def test_bounds(self, value: float, options: dict[str, bool], message: str) -> None:
        """Zero and negatives are refused unless allowed, and the message states the bound."""
        with pytest.raises(FieldValueError, match=message):
            check_seconds("wait_sec", value, **options)

    @pytest.mark.parametrize(
        ("value", "options"),
        [(2, {}), (0, {"allow_zero": True}), (-3, {"allow_negative": True}), (0.5, {})],
    )
    def test_accepted_values_come_back_as_floats(
        self, value: float, options: dict[str, bool]
    ) -> None:
        """An accepted value is returned as a float."""
        checked = check_seconds("wait_sec", value, **options)
        assert checked == value
        assert type(checked) is float

    def test_error_factory(self) -> None:
        """``error`` builds the exception raised from the message."""
        with pytest.raises(CustomError, match="wait_sec must be > 0"):
            check_seconds("wait_sec", 0, error=CustomError)


class TestCheckApiKey:
    @pytest.mark.parametrize("key", [None, "k", " spaced key "])
    def test_accepted(self, key: str | None) -> None:
        """None and non-blank strings come back unchanged."""
        assert check_api_key(key) == key

    @pytest.mark.parametrize(
        ("key", "got"), [("", "a blank string"), ("  \t", "a blank string"), (5, "int")]
    )
    def test_blank_or_not_a_string(self, key: Any, got: str) -> None:
        """Blank strings and non-strings are refused; the message names the kind given."""
        with pytest.raises(FieldValueError, match=f"non-blank string.*got {got}$") as info:
            check_api_key(key)
        assert info.value.field == "api_key"

    def test_control_characters_never_echo_the_key(self) -> None:
        """A key with a control character is refused without the key in the message."""
        with pytest.raises(CustomError, match="control characters") as info:
            check_api_key("secret\nkey", error=CustomError)
        assert "secret" not in str(info.value)
