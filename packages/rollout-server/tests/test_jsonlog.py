"""JSON log lines (``serve --log-format json``) and the command's observability options."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import pytest

from rollout_server import (
    ROLLOUT_SERVER_KEY,
    ExecutionBackend,
    ServeTargetError,
    create_rollout_server,
)
from rollout_server.cli._cli import main
from rollout_server.cli._options import build_parser
from rollout_server.cli._target import build_app
from rollout_server.observability._jsonlog import JsonFormatter, log_fields
from rollout_types import RolloutErrorCategory, RolloutStatus


def record(message: str, *args: Any, **extra: Any) -> logging.LogRecord:
    made = logging.getLogger("rollout_server.registry").makeRecord(
        "rollout_server.registry", logging.INFO, __file__, 1, message, args, None, extra=extra
    )
    made.created = 1_780_000_000.25
    return made


class TestJsonFormatter:
    def test_a_line_is_one_json_object_with_the_rollout_fields(self) -> None:
        """A per-rollout line has timestamp (UTC, ms), level, logger, the formatted message
        and the rollout's id, status and category as strings."""
        line = JsonFormatter().format(
            record(
                "Rollout %s finished: status=%s err_category=%s",
                "r1",
                "failure",
                "timeout",
                **log_fields("r1", RolloutStatus.FAILURE, RolloutErrorCategory.TIMEOUT),
            )
        )
        assert "\n" not in line
        assert json.loads(line) == {
            "timestamp": "2026-05-28T20:26:40.250Z",
            "level": "INFO",
            "logger": "rollout_server.registry",
            "message": "Rollout r1 finished: status=failure err_category=timeout",
            "rollout_id": "r1",
            "status": "failure",
            "category": "timeout",
        }

    def test_fields_that_do_not_apply_are_left_out(self) -> None:
        """A line about no rollout, or without a status or category, has none of those
        keys (never nulls)."""
        plain = json.loads(JsonFormatter().format(record("listening")))
        assert set(plain) == {"timestamp", "level", "logger", "message"}
        only_id = json.loads(JsonFormatter().format(record("x", **log_fields("r2"))))
        assert only_id["rollout_id"] == "r2"
        assert "status" not in only_id
        assert "category" not in only_id

    def test_the_traceback_goes_in_one_field(self) -> None:
        """An exception's traceback is the ``exception`` string of the same line."""
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            made = record("failed")
            made.exc_info = sys.exc_info()
        line = JsonFormatter().format(made)
        assert "\n" not in line
        document = json.loads(line)
        assert document["exception"].startswith("Traceback")
        assert "RuntimeError: boom" in document["exception"]

    def test_lines_stay_ascii_whatever_the_id(self) -> None:
        """A rollout id with a lone surrogate or non-ASCII letters still makes one ASCII
        line that decodes back to the same text."""
        rollout_id = "r\udc80-é"
        line = JsonFormatter().format(record("Rollout %s", rollout_id, **log_fields(rollout_id)))
        assert line.isascii()
        assert json.loads(line)["rollout_id"] == rollout_id


class TestCommandOptions:
    async def test_no_metrics_turns_the_route_off(self) -> None:
        """``--no-metrics`` builds a server without metrics; by default they are on."""

        class Idle(ExecutionBackend):
            async def execute(self, request: Any) -> Any:
                raise NotImplementedError

        with_metrics = await build_app(Idle(), build_parser().parse_args(["serve", "m:a"]))
        without = await build_app(
            Idle(), build_parser().parse_args(["serve", "m:a", "--no-metrics"])
        )
        assert with_metrics[ROLLOUT_SERVER_KEY].metrics is not None
        assert without[ROLLOUT_SERVER_KEY].metrics is None
        built = create_rollout_server(backend=Idle())
        with pytest.raises(ServeTargetError, match="--no-metrics"):
            await build_app(built, build_parser().parse_args(["serve", "m:a", "--no-metrics"]))

    def test_log_format_is_text_or_json(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--log-format`` takes ``text`` (the default) or ``json``; anything else is a
        usage error naming the choices."""
        assert build_parser().parse_args(["serve", "m:a"]).log_format == "text"
        assert build_parser().parse_args(["serve", "m:a", "--log-format", "json"]).log_format == (
            "json"
        )
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "m:a", "--log-format", "xml"])
        assert info.value.code == 2
        assert "'text', 'json'" in capsys.readouterr().err

    def test_the_command_logs_json_lines(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """With ``--log-format json`` and no logging set up yet, the command's own lines
        (here the error for a bad target) are JSON objects on stderr."""
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [])
        monkeypatch.setattr(root, "level", root.level)
        assert main(["serve", "no_such_module_here:app", "--log-format", "json"]) == 2
        for handler in root.handlers:
            handler.flush()
        (line,) = capsys.readouterr().err.splitlines()
        document = json.loads(line)
        assert document["level"] == "ERROR"
        assert document["logger"] == "rollout_server.cli"
        assert "no_such_module_here" in document["message"]
