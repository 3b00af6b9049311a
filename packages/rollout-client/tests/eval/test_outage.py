"""A run across a server outage (issue 28): admissions refused by a restarting server are
tried again with a fresh rollout id, the rollouts one restart failed count once towards the
stop rule, and the default client polls on the outage schedule."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_client import RetrySettings, RolloutClient, RolloutServersUnavailableError
from rollout_client.eval import EvalOptions, read_journal, run_eval
from rollout_client.eval._client_seam import default_client_factory
from rollout_client.eval._outage import (
    ADMISSION_OUTAGE_DELAYS_SEC,
    OUTAGE_RETRY,
    is_outage,
    restart_key,
)
from rollout_types import RolloutResultResponse, RolloutSample

pytestmark = pytest.mark.real_outage_schedule

RESTARTED = "the server process {} ended before the rollout finished"


def options(dataset: Path, tmp_path: Path, **overrides: Any) -> EvalOptions:
    values: dict[str, Any] = {
        "dataset": dataset,
        "server_url": "http://127.0.0.1:9",
        "chat_url": "http://127.0.0.1:9/v1",
        "output": tmp_path / "out",
        "progress": "off",
    }
    values.update(overrides)
    return EvalOptions(**values)


def passing(rid: str) -> RolloutResultResponse:
    return RolloutResultResponse(rollout_id=rid, status="success", sample=RolloutSample(reward=1.0))


class TestRestartKey:
    def test_the_restart_message_names_the_process(self) -> None:
        assert restart_key("internal_error", RESTARTED.format("abc-1")) == "abc-1"

    @pytest.mark.parametrize(
        ("category", "message"),
        [
            ("internal_error", "the workflow raised"),
            ("internal_error", None),
            ("lease_expired", RESTARTED.format("abc-1")),
            (None, RESTARTED.format("abc-1")),
        ],
    )
    def test_anything_else_is_no_restart(self, category: str | None, message: str | None) -> None:
        assert restart_key(category, message) is None


class TestIsOutage:
    @pytest.mark.parametrize(
        "exc",
        [
            aiohttp.ClientConnectionError("refused"),
            aiohttp.ServerDisconnectedError(),
            ConnectionRefusedError(),
            RolloutServersUnavailableError("none", rollout_id="r", reasons={"u": "down"}),
        ],
    )
    def test_unreachable_servers_are_an_outage(self, exc: Exception) -> None:
        assert is_outage(exc)

    @pytest.mark.parametrize(
        "exc",
        [
            aiohttp.ServerTimeoutError(),
            TimeoutError(),
            ValueError("bad request"),
            RolloutServersUnavailableError(
                "none", rollout_id="r", reasons={"u": "stopping"}, shutting_down=frozenset({"u"})
            ),
        ],
    )
    def test_timeouts_bad_input_and_shutting_down_are_not(self, exc: Exception) -> None:
        assert not is_outage(exc)


class TestDefaultClient:
    async def test_polls_retry_on_the_outage_schedule_unless_told_otherwise(self) -> None:
        client = default_client_factory(url="http://127.0.0.1:9")
        assert isinstance(client, RolloutClient)
        assert client._channel.settings.retry is OUTAGE_RETRY
        assert sum(OUTAGE_RETRY.transport_delays_sec) == pytest.approx(16.6)
        await client.aclose()
        own = RetrySettings(transport_delays_sec=())
        client = default_client_factory(url="http://127.0.0.1:9", retry=own)
        assert isinstance(client, RolloutClient)
        assert client._channel.settings.retry is own
        await client.aclose()


class TestAcrossOutage:
    async def test_refused_admissions_are_tried_again_with_a_fresh_id(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Row 1's first two admissions find no server; the third is admitted (another
        rollout id each time) and scored once: no infrastructure failure is recorded."""
        refused: list[str] = []

        def admit(request: dict[str, Any]) -> None:
            if request["label"] == "1" and len(refused) < 2:
                refused.append(request["rollout_id"])
                raise aiohttp.ClientConnectionError("Connection refused")

        async def behave(request: dict[str, Any], _cancelled: asyncio.Event) -> Any:
            return passing(request["rollout_id"])

        server = fakes.FakeServer(behave, admit=admit)
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert report.exit_code == 0
        assert report.summary["by_outcome"]["success"] == 5
        admitted = [r["rollout_id"] for r in server.requests if r["label"] == "1"]
        assert len(admitted) == 1
        assert len({*refused, *admitted}) == 3
        journal = read_journal(report.run_dir / "events.jsonl")
        assert [r.rollout_id for r in journal if r.row_index == 1] == admitted

    async def test_an_outage_longer_than_the_schedule_is_an_infra_failure(
        self, fakes: Any, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(
            "rollout_client.eval._scheduler.ADMISSION_OUTAGE_DELAYS_SEC", (0.0, 0.0)
        )
        calls: list[str] = []

        def admit(request: dict[str, Any]) -> None:
            if request["label"] == "2":
                calls.append(request["rollout_id"])
                raise aiohttp.ClientConnectionError("Connection refused")

        async def behave(request: dict[str, Any], _cancelled: asyncio.Event) -> Any:
            return passing(request["rollout_id"])

        server = fakes.FakeServer(behave, admit=admit)
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert len(calls) == 3  # the first attempt and one per delay
        (record,) = [r for r in read_journal(report.run_dir / "events.jsonl") if r.row_index == 2]
        assert record.outcome == "infra_failure"
        assert record.err_category == "transport_error"
        assert record.rollout_id == calls[-1]
        assert len(ADMISSION_OUTAGE_DELAYS_SEC) > 2  # the real schedule is longer

    async def test_the_failures_of_one_restart_count_once_towards_the_stop_rule(
        self, fakes: Any, tmp_path: Path
    ) -> None:
        """Six rollouts failed by the restart of process p1, with the stop rule at 2: the
        run does not stop; a second restart (p2) then counts as the second failure in a row
        and stops it."""
        rows = [{"user_prompt": f"q{i}", "label": str(i)} for i in range(12)]
        path = fakes_dataset(tmp_path, rows)

        async def behave(request: dict[str, Any], _cancelled: asyncio.Event) -> Any:
            index = int(request["label"])
            process = "p1" if index < 6 else "p2"
            return RolloutResultResponse(
                rollout_id=request["rollout_id"],
                status="failure",
                err_category="internal_error",
                err_message=RESTARTED.format(process),
            )

        server = fakes.FakeServer(behave)
        stream = io.StringIO()
        report = await run_eval(
            options(path, tmp_path, concurrency=1, max_consecutive_infra_failures=2),
            stream=stream,
            client_factory=server.factory,
        )
        journal = read_journal(report.run_dir / "events.jsonl")
        assert [r.row_index for r in journal] == [0, 1, 2, 3, 4, 5, 6]
        assert all(r.outcome == "infra_failure" and r.reward is None for r in journal)
        output = stream.getvalue()
        assert output.count("the rollout server restarted (process p1 ended)") == 1
        assert "stopped after 2 consecutive infrastructure failures" in output


def fakes_dataset(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
