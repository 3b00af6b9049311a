"""The rules that decide scores, with the real RolloutClient against a scripted rollout
server on 127.0.0.1: what each ending means (scored or not, done or pending), what a resume
runs again, the consecutive-failure stop, and a server that is shutting down."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rollout_client.eval import EvalOptions, EvalReport, read_journal, run_eval
from rollout_types import RolloutErrorCategory, RolloutStatus

from .conftest import RolloutScript, Watched, result_fields, write_dataset

Start = Callable[..., Awaitable[RolloutScript]]

RUN_SEC = 60.0
"""Bound on a run that would otherwise wait forever (never reached when all is well)."""


def options(dataset: Path, url: str, **overrides: Any) -> EvalOptions:
    values: dict[str, Any] = {
        "dataset": dataset,
        "server_url": url,
        "chat_url": url + "/v1",
        "output": dataset.parent / "out",
        "progress": "off",
        "max_consecutive_infra_failures": 0,
    }
    values.update(overrides)
    return EvalOptions(**values)


async def run(dataset: Path, script: RolloutScript, **overrides: Any) -> EvalReport:
    return await run_eval(options(dataset, script.url, **overrides), stream=io.StringIO())


def labelled(path: Path, labels: list[str]) -> Path:
    """A dataset with one row per label (the scripted server's key)."""
    return write_dataset(path, [{"user_prompt": "q", "label": label} for label in labels])


@dataclasses.dataclass(frozen=True)
class Ending:
    """One row of the outcome table: how a rollout ends and what the journal makes of it."""

    label: str
    outcome: str | None
    err_category: str | None
    scored: bool
    done: bool


def refuse_409(label: str) -> web.StreamResponse | None:
    if label != "admit-409":
        return None
    return web.json_response({"detail": "rollout_id is already registered"}, status=409)


def poll_500(label: str) -> dict[str, Any] | None:
    if label == "poll-500":
        raise web.HTTPInternalServerError(text='{"detail": "boom"}')
    return result_fields(label)


def all_pass(_label: str) -> dict[str, Any]:
    return result_fields("pass")


EXCEPTIONS = frozenset({"drop", "poll-500", "admit-409"})
"""Labels whose rollout ends in an exception on the client, not in a result."""


TABLE = [
    # Final: scored.
    Ending("pass", "success", None, scored=True, done=True),
    Ending("wrong", "success", None, scored=True, done=True),
    Ending("no-reward", "failed", "no_reward", scored=True, done=True),
    Ending("agent_error", "failed", "agent_error", scored=True, done=True),
    Ending("timeout", "failed", "timeout", scored=True, done=True),
    Ending("validation_error", "failed", "validation_error", scored=True, done=True),
    Ending("none", "failed", None, scored=True, done=True),
    # Final: not scored.
    Ending("removed", "skipped", None, scored=False, done=True),
    # Attempts: never scored, pending again.
    Ending("lease_expired", "infra_failure", "lease_expired", scored=False, done=False),
    Ending("internal_error", "infra_failure", "internal_error", scored=False, done=False),
    Ending("http_error", "infra_failure", "http_error", scored=False, done=False),
    Ending("quota_exceeded", "infra_failure", "quota_exceeded", scored=False, done=False),
    Ending("drop", "infra_failure", "transport_error", scored=False, done=False),
    Ending("poll-500", "infra_failure", "protocol_error", scored=False, done=False),
    Ending("admit-409", "infra_failure", "protocol_error", scored=False, done=False),
    # Not recorded: pending.
    Ending("cancelled", None, None, scored=False, done=False),
]


class TestOutcomeTable:
    def test_the_table_covers_every_status_and_category(self) -> None:
        """Every terminal status and every error category of the protocol has a row."""
        statuses = {
            result_fields(row.label)["status"] for row in TABLE if row.label not in EXCEPTIONS
        }
        terminal = (RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED)
        assert statuses == {str(status) for status in terminal}
        categories = {row.err_category for row in TABLE}
        assert {str(category) for category in RolloutErrorCategory} <= categories

    @pytest.mark.parametrize("row", TABLE, ids=[row.label for row in TABLE])
    async def test_ending_is_recorded_scored_and_resumed_as_the_table_says(
        self, rollout_script: Start, tmp_path: Path, row: Ending
    ) -> None:
        """A rollout ending as ``row`` is journaled with the row's outcome and category,
        scored or not, and run again on resume exactly when the row says it is pending."""
        dataset = labelled(tmp_path / "d.jsonl", [row.label, "pass"])
        first = await rollout_script(admit=refuse_409, outcome=poll_500)
        report = await run(dataset, first)
        latest = {r.row_index: r for r in read_journal(report.run_dir / "events.jsonl")}
        recorded = latest.get(0)
        assert (recorded.outcome if recorded else None) == row.outcome
        assert (recorded.err_category if recorded else None) == row.err_category
        assert report.summary["items"]["scored"] == 1 + row.scored
        assert report.summary["items"]["pending"] == (0 if row.done else 1)
        assert report.exit_code == (0 if row.done else 1)

        healthy = await rollout_script(outcome=all_pass)
        resumed = await run(dataset, healthy)
        assert healthy.posted == ([] if row.done else [row.label])
        assert resumed.summary["complete"] is True
        assert resumed.exit_code == 0


class TestResume:
    async def test_skipped_item_is_done_and_not_run_again(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """A removed sample (skipped) is done: resuming runs only the infrastructure failure,
        and the skipped item stays skipped, unscored, in the final summary."""
        dataset = labelled(tmp_path / "d.jsonl", ["removed", "lease_expired", "pass"])
        first = await run(dataset, await rollout_script())
        assert first.summary["by_outcome"]["skipped"] == 1
        assert first.summary["items"]["pending"] == 1
        healthy = await rollout_script(outcome=all_pass)
        second = await run(dataset, healthy)
        assert healthy.posted == ["lease_expired"]
        assert second.summary["by_outcome"] == {
            "success": 2,
            "failed": 0,
            "skipped": 1,
            "infra_failure": 0,
            "cancelled": 0,
            "not_started": 0,
        }
        assert second.summary["items"]["scored"] == 2
        assert second.summary["infra_failures"]["attempts"] == 1


class TestConsecutiveFailures:
    async def test_a_success_between_failures_resets_the_count(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """With a limit of 2, failures that never come two in a row never stop the run."""
        labels = ["lease_expired", "pass", "http_error", "pass", "internal_error"]
        dataset = labelled(tmp_path / "d.jsonl", labels)
        script = await rollout_script()
        report = await run(dataset, script, concurrency=1, max_consecutive_infra_failures=2)
        assert script.posted == labels
        assert report.stop_reason is None
        assert report.summary["items"]["pending"] == 3
        assert report.closing_line == (
            "rollout-eval: 3 items ended in an infrastructure failure (see the summary); "
            "3 items pending. Re-run the same command to resume."
        )

    async def test_failures_in_a_row_stop_the_run(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """Two infrastructure failures in a row (limit 2) stop the run: nothing more starts."""
        labels = ["pass", "lease_expired", "http_error", "pass", "pass"]
        dataset = labelled(tmp_path / "d.jsonl", labels)
        script = await rollout_script()
        report = await run(dataset, script, concurrency=1, max_consecutive_infra_failures=2)
        assert script.posted == labels[:3]
        assert report.stop_reason is not None
        assert "2 consecutive infrastructure failures (last: http_error" in report.stop_reason
        assert report.exit_code == 1
        assert report.closing_line is not None
        assert report.closing_line.endswith("; 4 items pending. Re-run the same command to resume.")


class TestServerShuttingDown:
    async def test_503_stops_admitting_and_collects_the_rollouts_in_flight(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """After a 503 "shutting down" on admission no rollout starts, none is cancelled,
        the rollouts in flight are recorded when they finish, and the rest stays pending."""
        shutting_down = False

        def admit(_label: str) -> web.StreamResponse | None:
            nonlocal shutting_down
            if len(script.admitted) < 2:
                return None
            shutting_down = True
            return web.json_response({"detail": "rollout server is shutting down"}, status=503)

        polls_after_503 = 0

        def outcome(label: str) -> dict[str, Any] | None:
            # The two admitted rollouts finish only after the 503 and a poll cycle more.
            nonlocal polls_after_503
            if not shutting_down:
                return None
            polls_after_503 += 1
            return None if polls_after_503 <= 2 else result_fields("pass")

        script = await rollout_script(admit=admit, outcome=outcome)
        dataset = labelled(tmp_path / "d.jsonl", [str(i) for i in range(6)])
        report = await run(dataset, script, concurrency=3, max_consecutive_infra_failures=5)
        assert len(script.posted) == 3
        assert script.cancelled == []
        records = read_journal(report.run_dir / "events.jsonl")
        assert sorted(r.outcome for r in records) == ["success", "success"]
        assert report.summary["items"]["pending"] == 4
        assert report.exit_code == 1
        assert report.stop_reason is not None
        assert "shutting down" in report.stop_reason
        assert report.closing_line == (
            "rollout-eval: the rollout server is shutting down (it answered 503 to a new "
            "rollout); 4 items pending. Re-run the same command to resume."
        )

    async def test_a_gateway_503_is_an_infrastructure_failure(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """A 503 without the shutting-down detail (a gateway's) is recorded per item."""
        script = await rollout_script(
            admit=lambda label: (
                web.Response(status=503, text="<html>Service Unavailable</html>")
                if label == "gw"
                else None
            )
        )
        dataset = labelled(tmp_path / "d.jsonl", ["gw", "pass", "pass"])
        report = await run(dataset, script, concurrency=1)
        assert script.posted == ["gw", "pass", "pass"]
        assert report.stop_reason is None
        (record, *_) = read_journal(report.run_dir / "events.jsonl")
        assert (record.outcome, record.err_category) == ("infra_failure", "protocol_error")


def gateway_503(_label: str) -> web.StreamResponse:
    return web.Response(status=503, text="<html>Service Unavailable</html>")


def shutting_down_503(_label: str) -> web.StreamResponse:
    return web.json_response({"detail": "rollout server is shutting down"}, status=503)


def refusing_after_one(
    script: RolloutScript, refusal: Callable[[str], web.StreamResponse]
) -> Callable[[str], web.StreamResponse | None]:
    """An admit script: the first rollout is admitted, every later one refused."""
    return lambda label: refusal(label) if script.admitted else None


class TestServersShuttingDown:
    """Several --server: the pool takes each server answering 503 out of rotation and
    raises once none is left; the run drains when one of them is shutting down."""

    @pytest.mark.parametrize(
        ("second_refusal", "why"),
        [
            (
                shutting_down_503,
                "every rollout server is shutting down (none admits a new rollout)",
            ),
            (
                gateway_503,
                "no rollout server admits new rollouts (1 shutting down; {second}: POST "
                "/rollout answered 503 (gateway))",
            ),
        ],
        ids=["both-shutting-down", "one-shutting-down-one-gateway"],
    )
    async def test_no_server_admitting_drains_the_run(
        self,
        rollout_script: Start,
        tmp_path: Path,
        second_refusal: Callable[[str], web.StreamResponse],
        why: str,
    ) -> None:
        """Each server admits one rollout and then refuses (503 "shutting down"; the second
        one a gateway's 503 in one case): no rollout starts after that, none is cancelled,
        both in flight are collected and recorded, and the rest stays pending."""
        stream = Watched("starting no new rollouts")

        def pass_once_drained(_label: str) -> dict[str, Any] | None:
            return result_fields("pass") if stream.seen.is_set() else None

        first = await rollout_script(outcome=pass_once_drained)
        second = await rollout_script(outcome=pass_once_drained)
        first.admit = refusing_after_one(first, shutting_down_503)
        second.admit = refusing_after_one(second, second_refusal)
        dataset = labelled(tmp_path / "d.jsonl", [str(i) for i in range(6)])
        async with asyncio.timeout(RUN_SEC):  # without a drain the two never finish
            report = await run_eval(
                options(
                    dataset,
                    first.url,
                    extra_server_urls=(second.url,),
                    concurrency=3,
                    max_consecutive_infra_failures=5,
                ),
                stream=stream,
            )
        # Each server admitted one row (the first it was sent) and refused the next, the
        # same row on both; which rows depends on the order the three workers start in.
        assert len(first.posted) == len(second.posted) == 2
        admitted = {first.posted[0], second.posted[0]}
        assert len(admitted) == 2
        assert first.posted[1] == second.posted[1]
        assert first.posted[1] not in admitted
        assert first.cancelled == second.cancelled == []
        records = read_journal(report.run_dir / "events.jsonl")
        assert sorted((r.row_index, r.outcome) for r in records) == [
            (int(row), "success") for row in sorted(admitted)
        ]
        assert report.summary["items"]["pending"] == 4
        assert report.exit_code == 1
        assert report.closing_line == (
            f"rollout-eval: {why.format(second=second.url)}; 4 items pending. Re-run the "
            "same command to resume."
        )

    async def test_no_server_shutting_down_is_an_infrastructure_failure(
        self, rollout_script: Start, tmp_path: Path
    ) -> None:
        """When every server answers a gateway's 503 the run does not drain: each item is
        recorded as an infrastructure failure and run again on resume."""
        first = await rollout_script(admit=gateway_503)
        second = await rollout_script(admit=gateway_503)
        dataset = labelled(tmp_path / "d.jsonl", ["0", "1"])
        report = await run_eval(
            options(dataset, first.url, extra_server_urls=(second.url,), concurrency=1),
            stream=io.StringIO(),
        )
        assert report.stop_reason is None
        records = read_journal(report.run_dir / "events.jsonl")
        assert [(r.outcome, r.err_category) for r in records] == [
            ("infra_failure", "transport_error"),
            ("infra_failure", "transport_error"),
        ]
        assert records[0].err_message is not None
        assert "RolloutServersUnavailableError" in records[0].err_message
        assert report.summary["items"]["pending"] == 2
