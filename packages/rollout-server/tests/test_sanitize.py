"""The wire-sample pipeline keeps the reward whatever the telemetry holds."""

from __future__ import annotations

import logging
import math
from decimal import Decimal
from fractions import Fraction

import pytest

from rollout_server._sanitize import fit_json, json_safe_sample, scrub_text
from rollout_types import RolloutSample, dumps


class Opaque:
    """A value JSON cannot encode."""


class NumpyLikeInt(int):
    """Stands in for numpy.int64: an Integral that is not a plain int."""


class TestFitJson:
    def test_foreign_numbers_normalised(self) -> None:
        """Integral and Real scalars of other types become plain int and float."""
        value, dropped = fit_json({"i": NumpyLikeInt(3), "f": Fraction(1, 2), "d": Decimal("1.5")})
        assert value == {"i": 3, "f": 0.5, "d": 1.5}
        assert type(value["i"]) is int
        assert dropped == []

    def test_non_finite_and_objects_dropped(self) -> None:
        """NaN, infinities and unencodable objects are dropped and listed."""
        value, dropped = fit_json({"bad": math.nan, "inf": math.inf, "obj": Opaque(), "ok": 1})
        assert value == {"ok": 1}
        assert sorted(dropped) == ["$.bad", "$.inf", "$.obj"]

    def test_keys(self) -> None:
        """Numeric keys become strings; boolean and other keys are dropped."""
        value, dropped = fit_json({1: "a", 2.5: "b", (1,): "d"})
        assert value == {"1": "a", "2.5": "b"}
        assert len(dropped) == 1
        assert fit_json({True: "c", None: "e"}) == ({}, ["$.True", "$.None"])

    def test_tuples_become_lists(self) -> None:
        """Tuples become lists, recursively."""
        assert fit_json({"t": (1, (2, 3))})[0] == {"t": [1, [2, 3]]}

    def test_surrogates_replaced(self) -> None:
        """Lone surrogates in strings are replaced so the text is valid UTF-8."""
        assert scrub_text("a\udcffb") == "a?b"
        assert fit_json({"s": "x\ud800"})[0] == {"s": "x?"}


class TestJsonSafeSample:
    def test_bad_metrics_keep_reward(self, caplog: pytest.LogCaptureFixture) -> None:
        """Non-JSON metrics are dropped with one warning and the reward survives."""
        sample = RolloutSample(reward=0.5, metrics={"bad": math.nan, "obj": Opaque()})
        with caplog.at_level(logging.WARNING, logger="rollout_server.sanitize"):
            safe = json_safe_sample(sample, context="r1")
        assert safe.metrics == {}
        assert safe.reward == 0.5
        assert len(caplog.records) == 1
        assert "r1" in caplog.records[0].getMessage()
        dumps(safe)

    def test_bad_messages_minimal_sample(self) -> None:
        """Non-JSON content in messages yields the minimal sample that keeps the reward."""
        sample = RolloutSample(
            messages=[{"role": "assistant", "content": Opaque()}],
            label="L",
            reward=0.5,
            remove_sample=True,
            metrics={"m": 1},
        )
        safe = json_safe_sample(sample)
        assert safe == RolloutSample(messages=[], label="L", reward=0.5, remove_sample=True)

    def test_nan_in_messages(self) -> None:
        """NaN inside messages also falls back to the minimal sample."""
        safe = json_safe_sample(RolloutSample(messages=[{"x": math.nan}], reward=1.0))
        assert safe.messages == []
        assert safe.reward == 1.0

    def test_clean_sample_unchanged(self) -> None:
        """A sample that is already JSON comes back equal."""
        sample = RolloutSample(
            messages=[{"role": "assistant", "content": "hi"}],
            label="L",
            reward=0.5,
            metrics={"a": 1.0},
        )
        assert json_safe_sample(sample) == sample
