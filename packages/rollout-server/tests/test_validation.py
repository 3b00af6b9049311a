"""The 422 errors the routes build themselves have osmosis-ai's exact shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_server.http._validation import header_error, too_deep_error, unencodable_id_error
from rollout_types import LEASE_HEADER, REDACTED

GOLDEN = Path(__file__).resolve().parents[2] / "rollout-types" / "tests" / "data" / "golden"
"""Payloads captured from osmosis-ai (``tools/capture_golden.py``), kept with rollout-types."""


def _golden(name: str) -> Any:
    return json.loads((GOLDEN / "osmosis-0.3.8" / name).read_text("utf-8"))


class TestHeaders:
    def test_missing_header(self) -> None:
        """A missing lease header is missing at loc header/name with null input."""
        assert header_error("X-Osmosis-Rollout-Lease", None).body == {
            "detail": [
                {
                    "type": "missing",
                    "loc": ["header", "X-Osmosis-Rollout-Lease"],
                    "msg": "Field required",
                    "input": None,
                }
            ]
        }

    def test_empty_header(self) -> None:
        """An empty lease header is string_too_short with min_length 1."""
        (error,) = header_error("X-Osmosis-Rollout-Lease", "").errors
        assert error["type"] == "string_too_short"
        assert error["ctx"] == {"min_length": 1}
        assert error["loc"] == ["header", "X-Osmosis-Rollout-Lease"]

    def test_a_non_empty_value_is_redacted(self) -> None:
        """A header value shown in an entry is redacted (it may be a lease token)."""
        (error,) = header_error(LEASE_HEADER, " ").errors
        assert error["input"] == REDACTED

    @pytest.mark.parametrize(
        ("name", "value"),
        [("error_422_missing_header.json", None), ("error_422_empty_header.json", "")],
    )
    def test_header_errors_match_osmosis(self, name: str, value: str | None) -> None:
        """A missing or empty lease header gives osmosis's exact 422 entry."""
        (expected,) = _golden(name)["detail"]
        (ours,) = header_error(LEASE_HEADER, value).errors
        assert (ours["type"], ours["loc"], ours["msg"]) == (
            expected["type"],
            expected["loc"],
            expected["msg"],
        )


class TestBodyErrors:
    def test_too_deep_is_a_json_decode_error(self) -> None:
        """A body nested too deeply is refused as json_invalid at the body's start."""
        (error,) = too_deep_error().errors
        assert (error["type"], error["loc"], error["msg"]) == (
            "json_invalid",
            ["body", 0],
            "JSON decode error",
        )

    def test_an_unencodable_id_names_the_field(self) -> None:
        """A rollout_id with a lone surrogate is a value_error at body/rollout_id that says
        why."""
        (error,) = unencodable_id_error("a\ud800").errors
        assert (error["type"], error["loc"]) == ("value_error", ["body", "rollout_id"])
        assert "lone surrogate" in error["msg"]
