"""Log lines an operator can use: caller text escaped so it cannot forge a line, one line
per finished rollout, and tracebacks of expected user-code failures only at DEBUG."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from rollout_server import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    LocalBackend,
    WorkflowContext,
)
from rollout_server._logtext import MAX_LOGGED_CHARS, get_logger, log_text

EVIL = "evil\nFORGED-LOG-LINE"
EVIL_PATH = quote(EVIL, safe="")
"""The id as a URL path segment (a raw line break would be dropped from the URL)."""


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every captured record's message (format string and arguments, no traceback)."""
    return [record.getMessage() for record in caplog.records]


def assert_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    for message in messages(caplog):
        assert "\n" not in message, message
        assert "\r" not in message, message


class FailingWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        raise ValueError(f"no answer for {ctx.rollout_id}")


class EmptyWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[])


class AnswerWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[{"role": "assistant", "content": "42"}])


def local(workflow: Any, tmp_path: Path) -> LocalBackend:
    return LocalBackend(
        workflow,
        workflow_config=AgentWorkflowConfig(name="t", concurrency={"max_concurrent": 2}),
        artifact_root=tmp_path,
    )


class TestLogText:
    def test_printable_text_is_kept(self) -> None:
        """Printable text, non-ASCII letters included, is logged as it is."""
        assert log_text("r-1 界 é") == "r-1 界 é"

    @pytest.mark.parametrize(
        ("value", "shown"),
        [
            (EVIL, "'evil\\nFORGED-LOG-LINE'"),
            ("a\rb", "'a\\rb'"),
            ("\x1b[31mred", "'\\x1b[31mred'"),
            ("line\u2028sep", "'line\\u2028sep'"),
            ("lone\ud800", "'lone\\ud800'"),
        ],
    )
    def test_other_text_is_shown_as_its_repr(self, value: str, shown: str) -> None:
        """Line breaks, control characters, escapes and lone surrogates are shown
        escaped, as repr shows them."""
        assert log_text(value) == shown

    def test_long_text_is_cut(self) -> None:
        """Text beyond MAX_LOGGED_CHARS is cut, with the number of characters left out."""
        text = log_text("x" * (MAX_LOGGED_CHARS + 7))
        assert text == "x" * MAX_LOGGED_CHARS + "...(+7 chars)"

    def test_the_filter_escapes_every_argument(self, caplog: pytest.LogCaptureFixture) -> None:
        """A server logger escapes str, exception and other arguments, keeps numbers, and
        gives %r the escaped repr."""
        logger = get_logger("rollout_server.test_log_lines")
        with caplog.at_level(logging.INFO, logger="rollout_server.test_log_lines"):
            logger.info("%s %r %d %.1f %s", EVIL, EVIL, 3, 0.5, ValueError("x\ny"))
        assert messages(caplog) == [
            "'evil\\nFORGED-LOG-LINE' 'evil\\nFORGED-LOG-LINE' 3 0.5 'x\\ny'"
        ]


class TestCallerTextIsEscaped:
    async def test_an_id_with_a_line_break_forges_no_line(
        self, harness: Any, caplog: pytest.LogCaptureFixture, body: Any
    ) -> None:
        """An id and an error message holding line breaks reach every log line escaped:
        admission, failure, cancellation and backend errors all log one line each."""
        harness.backend.cancel_answers = RuntimeError("backend\nFORGED")
        with caplog.at_level(logging.DEBUG, logger="rollout_server"):
            token = await harness.admit(EVIL)
            (await harness.backend.started(EVIL)).raise_(ValueError("boom\nFORGED-2"))
            await harness.poll_until(EVIL_PATH, token, "failure")
            second = EVIL + "-2"
            await harness.admit(second)
            await harness.backend.started(second)
            await harness.cancel({"ids": [second]})
        assert_one_line_each(caplog)
        text = "\n".join(messages(caplog))
        assert "Rollout 'evil\\nFORGED-LOG-LINE' finished: status=failure" in text
        assert "err_message='boom\\nFORGED-2'" in text
        assert "Backend cancellation failed for rollout(s) 'evil\\nFORGED-LOG-LINE-2'" in text

    async def test_local_backend_lines_are_escaped(
        self, make_harness: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """LocalBackend's own lines (a failing workflow, a saved trajectory) and the
        finished line escape the id, the path holding it and the exception text."""
        for workflow in (FailingWorkflow, EmptyWorkflow):
            harness = await make_harness(local(workflow, tmp_path / workflow.__name__))
            with caplog.at_level(logging.DEBUG, logger="rollout_server"):
                token = await harness.admit(EVIL)
                await harness.poll_until(EVIL_PATH, token, "failure", "success")
        assert_one_line_each(caplog)
        text = "\n".join(messages(caplog))
        assert "Workflow of rollout 'evil\\nFORGED-LOG-LINE' failed" in text
        assert "Rollout 'evil\\nFORGED-LOG-LINE': trajectory saved in '/" in text


class TestFinishedLines:
    async def test_an_expected_failure_is_one_info_line(
        self, make_harness: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A workflow that raises logs one INFO line (id, status, category, duration,
        reward, message; the first three also as the record's fields for JSON logs) and
        its traceback once, at DEBUG; nothing at WARNING or above."""
        harness = await make_harness(local(FailingWorkflow, tmp_path))
        with caplog.at_level(logging.DEBUG, logger="rollout_server"):
            token = await harness.admit("r1")
            await harness.poll_until("r1", token, "failure")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        info = [r for r in caplog.records if r.levelno == logging.INFO]
        (record,) = [r for r in info if "r1" in r.getMessage()]
        fields = {key: record.__dict__.get(key) for key in ("rollout_id", "status", "category")}
        assert fields == {"rollout_id": "r1", "status": "failure", "category": "validation_error"}
        line = record.getMessage()
        assert line.startswith(
            "Rollout r1 finished: status=failure err_category=validation_error duration="
        )
        assert line.endswith("s reward=None err_message=no answer for r1")
        tracebacks = [r for r in caplog.records if r.exc_info is not None]
        assert [(r.levelno, r.getMessage()) for r in tracebacks] == [
            (logging.DEBUG, "Workflow of rollout r1 failed")
        ]

    async def test_a_timeout_is_one_info_line(
        self, make_harness: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A rollout that times out in the queue logs one INFO line with the timeout
        category and the deadline message, no WARNING."""
        harness = await make_harness(local(AnswerWorkflow, tmp_path))
        with caplog.at_level(logging.INFO, logger="rollout_server"):
            token = await harness.admit("r1", agent_timeout_sec=0)
            await harness.poll_until("r1", token, "failure")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        (line,) = [m for m in messages(caplog) if "r1" in m]
        assert "status=failure err_category=timeout" in line
        assert "err_message=workflow exceeded its 0.0s deadline" in line

    async def test_a_success_is_one_debug_line(
        self, make_harness: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A success logs its finished line at DEBUG (shown with --log-level DEBUG), with
        its reward, and nothing at INFO."""
        harness = await make_harness()
        with caplog.at_level(logging.DEBUG, logger="rollout_server"):
            token = await harness.admit("r1")
            (await harness.backend.started("r1")).succeed(0.75)
            await harness.poll_until("r1", token, "success")
        finished = [r for r in caplog.records if "finished" in r.getMessage()]
        assert [r.levelno for r in finished] == [logging.DEBUG]
        assert "status=success err_category=None" in finished[0].getMessage()
        assert "reward=0.75 err_message=None" in finished[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.INFO]
