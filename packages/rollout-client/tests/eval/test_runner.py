"""The evaluation runner against an in-memory fake server and client."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_client import RolloutClient
from rollout_client.eval import (
    EvalInputError,
    EvalOptions,
    ManifestMismatchError,
    RunControl,
    RunStateError,
    ServerUnavailableError,
    classify_result,
    read_journal,
    run_eval,
)
from rollout_client.eval._keys import EnvKey
from rollout_client.eval._probe import capacity_from_health
from rollout_types import RolloutResultResponse, RolloutSample


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


def by_label(results: dict[str, str]) -> Any:
    """A behaviour: reward 1 for labels listed as "pass", 0 for "wrong", else a failure."""

    async def behave(request: dict[str, Any], _cancelled: asyncio.Event) -> RolloutResultResponse:
        await asyncio.sleep(0)
        kind = results.get(request["label"], "pass")
        rid = request["rollout_id"]
        if kind == "pass":
            return RolloutResultResponse(
                rollout_id=rid, status="success", sample=RolloutSample(reward=1.0)
            )
        if kind == "wrong":
            return RolloutResultResponse(
                rollout_id=rid, status="success", sample=RolloutSample(reward=0.0)
            )
        if kind == "removed":
            return RolloutResultResponse(
                rollout_id=rid,
                status="success",
                sample=RolloutSample(remove_sample=True),
            )
        return RolloutResultResponse(
            rollout_id=rid, status="failure", err_category=kind, err_message=f"{kind} happened"
        )

    return behave


class TestRunEval:
    async def test_complete_run_writes_journal_manifest_and_summary(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Every item runs once with its row's prompt and label, and the summary counts them."""
        server = fakes.FakeServer(by_label({"1": "wrong", "2": "agent_error"}))
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert report.exit_code == 0
        assert len(server.requests) == 5
        first = next(r for r in server.requests if r["label"] == "3")
        assert first["initial_messages"] == [{"role": "user", "content": "What is 3 + 0?"}]
        assert first["extra_fields"] == {"row_index": 3, "run_index": 0}
        assert len({r["rollout_id"] for r in server.requests}) == 5
        summary = json.loads((report.run_dir / "summary.json").read_text())
        assert summary["by_outcome"]["success"] == 4
        assert summary["by_outcome"]["failed"] == 1
        assert summary["by_err_category"] == {"agent_error": 1}
        assert summary["pass"]["passed"] == 3
        assert summary["reward"]["mean"] == pytest.approx(3 / 5)
        assert (report.run_dir / "manifest.json").exists()
        assert len(read_journal(report.run_dir / "events.jsonl")) == 5
        assert "pass rate" in report.summary_text

    async def test_infrastructure_failures_are_not_scored(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """lease_expired, internal_error and http_error results are infra failures, not zeros."""
        server = fakes.FakeServer(
            by_label({"0": "lease_expired", "1": "internal_error", "2": "http_error"})
        )
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        summary = report.summary
        assert report.exit_code == 1
        assert summary["by_outcome"]["infra_failure"] == 3
        assert summary["reward"]["count"] == 2
        assert summary["reward"]["mean"] == 1.0
        assert summary["items"]["pending"] == 3
        assert summary["by_err_category"] == {
            "http_error": 1,
            "internal_error": 1,
            "lease_expired": 1,
        }

    async def test_transport_and_protocol_errors_are_infra_failures(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Exceptions while polling are recorded with a client-side category, never as 0."""
        from rollout_client import RolloutProtocolError

        async def behave(request: dict[str, Any], _c: asyncio.Event) -> RolloutResultResponse:
            if request["label"] == "0":
                raise aiohttp.ServerDisconnectedError()
            if request["label"] == "1":
                raise RolloutProtocolError("GET /rollout/x/result returned 404", status_code=404)
            return RolloutResultResponse(
                rollout_id=request["rollout_id"], status="success", sample=RolloutSample(reward=1)
            )

        server = fakes.FakeServer(behave)
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        records = {r.row_index: r for r in read_journal(report.run_dir / "events.jsonl")}
        assert records[0].outcome == "infra_failure"
        assert records[0].err_category == "transport_error"
        assert records[1].err_category == "protocol_error"
        assert "404" in (records[1].err_message or "")
        assert report.summary["reward"]["count"] == 3

    async def test_consecutive_infra_failures_stop_the_run(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """After N infrastructure failures in a row no new rollout starts; the reason is given."""

        async def behave(request: dict[str, Any], _c: asyncio.Event) -> RolloutResultResponse:
            raise aiohttp.ClientConnectionError("connection refused")

        server = fakes.FakeServer(behave)
        report = await run_eval(
            options(dataset, tmp_path, concurrency=1, max_consecutive_infra_failures=2),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        assert len(server.requests) == 2
        assert report.exit_code == 1
        assert report.stop_reason is not None
        assert "2 consecutive infrastructure failures" in report.stop_reason
        assert report.summary["items"]["pending"] == 5

    async def test_admission_errors_are_infra_failures(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """An admission timeout is recorded as ``admission_timeout`` and the item stays pending."""
        from rollout_client import RolloutAdmissionTimeoutError

        def admit(request: dict[str, Any]) -> None:
            if request["label"] == "4":
                raise RolloutAdmissionTimeoutError(
                    "admission timed out",
                    rollout_id=request["rollout_id"],
                    may_have_succeeded=False,
                )

        server = fakes.FakeServer(by_label({}), admit=admit)
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert report.summary["by_err_category"] == {"admission_timeout": 1}
        assert report.summary["items"]["pending"] == 1

    async def test_default_concurrency_is_the_server_capacity(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Without --concurrency at most the /health capacity is in flight at once."""
        release = asyncio.Event()

        async def behave(request: dict[str, Any], _c: asyncio.Event) -> RolloutResultResponse:
            if server.in_flight >= 2:
                release.set()
            await release.wait()
            return RolloutResultResponse(
                rollout_id=request["rollout_id"], status="success", sample=RolloutSample(reward=1)
            )

        server = fakes.FakeServer(
            behave, health={"concurrency": {"max_concurrent": 2, "queued": 0, "running": 0}}
        )
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert report.exit_code == 0
        assert server.max_in_flight == 2
        assert report.summary["run"]["concurrency"] == 2

    async def test_several_servers_run_through_one_pool_client(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """With extra servers each is checked on its own, their capacities add up, and the
        rollouts and their cancels go through one client built with every URL."""
        server = fakes.FakeServer(by_label({}))
        urls = ("http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11")
        report = await run_eval(
            options(dataset, tmp_path, extra_server_urls=urls[1:]),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        assert report.exit_code == 0
        assert [kwargs.get("url") for kwargs in server.client_kwargs[:3]] == list(urls)
        (pool_kwargs,) = server.client_kwargs[3:]
        assert pool_kwargs["urls"] == urls
        assert report.summary["run"]["concurrency"] == 5  # 3 x 3 capacity, 5 items
        assert report.summary["run"]["server_urls"] == list(urls)

    async def test_remove_sample_is_skipped(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """A success with remove_sample is skipped: done, but neither scored nor pending."""
        server = fakes.FakeServer(by_label({"0": "removed"}))
        report = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        assert report.summary["by_outcome"]["skipped"] == 1
        assert report.summary["reward"]["count"] == 4
        assert report.summary["complete"] is True

    async def test_n_repetitions_report_pass_at_k(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """--n 2 runs every row twice and reports pass@1 and pass@2."""
        server = fakes.FakeServer(by_label({"0": "wrong"}))
        report = await run_eval(
            options(dataset, tmp_path, n=2, rows="0-1"),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        assert sorted(
            (r["extra_fields"]["row_index"], r["extra_fields"]["run_index"])
            for r in server.requests
        ) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert report.summary["pass_at_k"]["1"]["value"] == 0.5
        assert report.summary["pass_at_k"]["2"]["value"] == 0.5


class TestResume:
    async def test_resume_runs_only_pending_items(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """A second run retries the infra failures only and ends with the full summary."""
        failing = fakes.FakeServer(by_label({"2": "lease_expired"}))
        first = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=failing.factory
        )
        assert first.summary["items"]["pending"] == 1
        healthy = fakes.FakeServer(by_label({}))
        second = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=healthy.factory
        )
        assert [r["label"] for r in healthy.requests] == ["2"]
        assert second.exit_code == 0
        assert second.summary["by_outcome"]["success"] == 5
        assert second.summary["infra_failures"]["attempts"] == 1

    async def test_nothing_pending_runs_nothing(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Re-running a complete run contacts no server and reproduces the summary."""
        server = fakes.FakeServer(by_label({"1": "wrong"}))
        first = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        again = fakes.FakeServer(by_label({}))
        second = await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=again.factory
        )
        assert again.requests == []
        assert again.client_kwargs == []
        for key in ("by_outcome", "reward", "pass", "latency_sec", "items"):
            assert second.summary[key] == first.summary[key]

    async def test_changed_inputs_are_refused(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Resuming with another --n lists what changed and suggests --fresh."""
        server = fakes.FakeServer(by_label({}))
        await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        with pytest.raises(ManifestMismatchError, match=r"--n \(1 -> 2\)") as caught:
            await run_eval(
                options(dataset, tmp_path, n=2), stream=io.StringIO(), client_factory=server.factory
            )
        assert "--fresh" in str(caught.value)

    async def test_fresh_archives_the_previous_run(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """--fresh moves the old run aside and runs every item again."""
        server = fakes.FakeServer(by_label({}))
        await run_eval(
            options(dataset, tmp_path), stream=io.StringIO(), client_factory=server.factory
        )
        report = await run_eval(
            options(dataset, tmp_path, n=2, mode="fresh"),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        assert len(server.requests) == 5 + 10
        archived = [p.name for p in (tmp_path / "out").iterdir() if ".archived-" in p.name]
        assert len(archived) == 1
        assert report.summary["items"]["total"] == 10

    async def test_resume_flag_needs_an_existing_run(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """--resume without a run to resume is a clear error."""
        server = fakes.FakeServer(by_label({}))
        with pytest.raises(RunStateError, match="no run 'tiny'"):
            await run_eval(
                options(dataset, tmp_path, mode="resume"),
                stream=io.StringIO(),
                client_factory=server.factory,
            )


def interrupted_at(fakes: Any, control: RunControl, *, in_flight: int) -> Any:
    """A fake server whose rollouts run until cancelled; ``control`` is interrupted once
    ``in_flight`` of them run."""

    async def behave(request: dict[str, Any], cancelled: asyncio.Event) -> RolloutResultResponse:
        if server.in_flight == in_flight:
            control.request_stop("interrupted", interrupted=True)
        return await fakes.until_cancelled(request, cancelled)

    server = fakes.FakeServer(behave)
    return server


class TestStop:
    async def test_stop_cancels_in_flight_rollouts_and_leaves_them_pending(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """A stop request cancels every in-flight rollout on the server and records none."""
        control = RunControl()
        server = interrupted_at(fakes, control, in_flight=2)
        report = await run_eval(
            options(dataset, tmp_path, concurrency=2),
            stream=io.StringIO(),
            control=control,
            client_factory=server.factory,
        )
        assert report.exit_code == 130
        assert sorted(server.cancel_requests) == sorted(r["rollout_id"] for r in server.requests)
        assert len(server.requests) == 2
        assert read_journal(report.run_dir / "events.jsonl") == []
        assert report.summary["items"]["pending"] == 5
        assert report.summary["by_outcome"]["cancelled"] == 2
        assert report.summary["by_outcome"]["not_started"] == 3
        assert re.search(r"^  cancelled +2$", report.summary_text, re.MULTILINE)

    async def test_the_stop_rule_counts_the_rollouts_it_cancelled(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Rollouts in flight when consecutive infrastructure failures stop the run count as
        cancelled in the summary, not as not_started."""

        async def behave(
            request: dict[str, Any], cancelled: asyncio.Event
        ) -> RolloutResultResponse:
            if request["label"] in ("0", "1"):
                raise aiohttp.ClientConnectionError("connection refused")
            return await fakes.until_cancelled(request, cancelled)

        server = fakes.FakeServer(behave)
        async with asyncio.timeout(10):
            report = await run_eval(
                options(dataset, tmp_path, concurrency=3, max_consecutive_infra_failures=2),
                stream=io.StringIO(),
                client_factory=server.factory,
            )
        outcomes = report.summary["by_outcome"]
        assert outcomes["infra_failure"] == 2
        assert outcomes["cancelled"] == len(server.cancel_requests) > 0
        assert outcomes["cancelled"] + outcomes["not_started"] == 3
        assert report.summary["items"]["pending"] == 5

    async def test_a_stop_during_a_drain_cancels_what_is_collected(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Ctrl-C while a drain collects the rollouts in flight cancels them on the server;
        they stay pending and the run ends as interrupted."""
        from rollout_client import RolloutProtocolError

        control = RunControl()

        def admit(_request: dict[str, Any]) -> None:
            if server.requests:  # the second admission: the server is shutting down
                raise RolloutProtocolError(
                    "POST /rollout returned 503; only 202 and 429 are accepted: rollout "
                    "server is shutting down",
                    status_code=503,
                )

        async def behave(
            request: dict[str, Any], cancelled: asyncio.Event
        ) -> RolloutResultResponse:
            await control.stop.wait()  # the drain began
            assert control.draining
            control.request_stop("interrupted by SIGINT", interrupted=True)
            return await fakes.until_cancelled(request, cancelled)

        server = fakes.FakeServer(behave, admit=admit)
        report = await run_eval(
            options(dataset, tmp_path, concurrency=2),
            stream=io.StringIO(),
            control=control,
            client_factory=server.factory,
        )
        assert report.exit_code == 130
        assert server.cancel_requests == [server.requests[0]["rollout_id"]]
        assert read_journal(report.run_dir / "events.jsonl") == []
        assert report.closing_line == (
            "rollout-eval: interrupted; 5 items pending. Re-run the same command to resume."
        )

    async def test_failed_cancels_make_one_message(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Cancels that fail (a server gone) are reported once, with their count."""
        control = RunControl()
        server = interrupted_at(fakes, control, in_flight=3)
        server.cancel_error = ConnectionRefusedError(111, "Connection refused")
        stream = io.StringIO()
        await run_eval(
            options(dataset, tmp_path, concurrency=3),
            stream=stream,
            control=control,
            client_factory=server.factory,
        )
        assert len(server.cancel_requests) == 3
        lines = [line for line in stream.getvalue().splitlines() if "could not cancel" in line]
        assert lines == [
            "rollout-eval: could not cancel 3 rollout(s) on the server (last: "
            "ConnectionRefusedError: [Errno 111] Connection refused); their polling leases "
            "expire instead"
        ]

    async def test_stop_abandons_admissions_in_progress(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """A stop while admissions wait (e.g. on 429s) ends them at once; nothing is recorded."""
        control = RunControl()
        server = fakes.FakeServer(
            by_label({}),
            admit=lambda _request: control.request_stop("interrupted", interrupted=True),
            admit_gate=asyncio.Event(),
        )
        async with asyncio.timeout(10):
            report = await run_eval(
                options(dataset, tmp_path),
                stream=io.StringIO(),
                control=control,
                client_factory=server.factory,
            )
        assert report.exit_code == 130
        assert server.requests == []
        assert read_journal(report.run_dir / "events.jsonl") == []
        assert report.summary["by_outcome"]["cancelled"] == 3  # the default concurrency

    async def test_item_deadline_cancels_and_records_infra_failure(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """A rollout that outlives --item-deadline-sec is cancelled and counted as infra."""

        async def behave(
            request: dict[str, Any], cancelled: asyncio.Event
        ) -> RolloutResultResponse:
            if request["label"] == "0":
                return await fakes.until_cancelled(request, cancelled)
            return RolloutResultResponse(
                rollout_id=request["rollout_id"], status="success", sample=RolloutSample(reward=1)
            )

        server = fakes.FakeServer(behave)
        report = await run_eval(
            options(dataset, tmp_path, item_deadline_sec=0.05),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        records = {r.row_index: r for r in read_journal(report.run_dir / "events.jsonl")}
        assert records[0].err_category == "deadline_exceeded"
        assert len(server.cancel_requests) == 1

    async def test_unwritable_journal_stops_the_run_and_raises(
        self, fakes: Any, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When a journal write fails the other rollouts are cancelled and the error raised."""
        from rollout_client.eval import Journal

        def full_disk(_self: Journal, _record: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Journal, "append", full_disk)

        async def behave(
            request: dict[str, Any], cancelled: asyncio.Event
        ) -> RolloutResultResponse:
            if request["label"] == "0":
                return RolloutResultResponse(
                    rollout_id=request["rollout_id"],
                    status="success",
                    sample=RolloutSample(reward=1),
                )
            return await fakes.until_cancelled(request, cancelled)

        server = fakes.FakeServer(behave)
        with pytest.raises(OSError, match="No space left"):
            async with asyncio.timeout(10):
                await run_eval(
                    options(dataset, tmp_path, concurrency=3),
                    stream=io.StringIO(),
                    client_factory=server.factory,
                )
        assert len(server.cancel_requests) == 2


class TestServerChecks:
    async def test_unreachable_server_is_a_clear_error(self, dataset: Path, tmp_path: Path) -> None:
        """A server nobody listens on fails before any rollout, naming the URL."""
        with pytest.raises(ServerUnavailableError, match=r"cannot reach the rollout server"):
            await run_eval(options(dataset, tmp_path), stream=io.StringIO())

    async def test_bad_options_fail_before_anything_runs(
        self, dataset: Path, tmp_path: Path
    ) -> None:
        """An invalid option raises EvalInputError naming the flag."""
        with pytest.raises(EvalInputError, match="--concurrency"):
            await run_eval(options(dataset, tmp_path, concurrency=0), stream=io.StringIO())
        assert not (tmp_path / "out").exists()

    async def test_a_server_listed_twice_is_refused(self, dataset: Path, tmp_path: Path) -> None:
        """The same --server twice (trailing slash aside) raises EvalInputError."""
        with pytest.raises(EvalInputError, match="--server lists a URL twice"):
            await run_eval(
                options(dataset, tmp_path, extra_server_urls=("http://127.0.0.1:9/",)),
                stream=io.StringIO(),
            )

    async def test_each_server_is_checked_before_any_rollout(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """An unreachable extra server fails the run before any rollout, naming it."""
        server = fakes.FakeServer(by_label({}))
        unreachable = "http://127.0.0.1:10"

        def factory(**kwargs: Any) -> Any:
            if kwargs.get("url") == unreachable:
                return RolloutClient(**kwargs)  # nobody listens there
            return server.factory(**kwargs)

        with pytest.raises(ServerUnavailableError, match=f"rollout server at {unreachable} "):
            await run_eval(
                options(dataset, tmp_path, extra_server_urls=(unreachable,)),
                stream=io.StringIO(),
                client_factory=factory,
            )
        assert server.requests == []


def refusing_app(path: str, status: int) -> web.Application:
    """An app that answers ``status`` (401, 403) to ``GET path``, as to a wrong key."""

    async def refuse(_request: web.Request) -> web.Response:
        return web.json_response({"detail": "invalid API key"}, status=status)

    app = web.Application()
    app.router.add_get(path, refuse)
    return app


class TestStartupChecks:
    async def test_a_failed_server_check_creates_no_run_directory(
        self, dataset: Path, tmp_path: Path
    ) -> None:
        """An unreachable server fails the run before anything is written, so the next
        attempt (with the right URL) starts afresh with no "URL changed" warning."""
        with pytest.raises(ServerUnavailableError):
            await run_eval(options(dataset, tmp_path, name="r"), stream=io.StringIO())
        assert not (tmp_path / "out").exists()

    async def test_a_failed_check_of_fresh_keeps_the_previous_run(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """--fresh archives the previous run only once the servers answered."""
        server = fakes.FakeServer(by_label({}))
        first = await run_eval(
            options(dataset, tmp_path, name="r"),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        with pytest.raises(ServerUnavailableError):
            await run_eval(options(dataset, tmp_path, name="r", mode="fresh"), stream=io.StringIO())
        assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["r"]
        assert len(read_journal(first.run_dir / "events.jsonl")) == 5

    async def test_a_finished_run_is_summarised_without_a_server(
        self, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Re-running a run with nothing pending checks no server (it has nothing to run)."""
        server = fakes.FakeServer(by_label({}))
        await run_eval(
            options(dataset, tmp_path, name="r"),
            stream=io.StringIO(),
            client_factory=server.factory,
        )
        again = await run_eval(options(dataset, tmp_path, name="r"), stream=io.StringIO())
        assert again.exit_code == 0
        assert again.summary["by_outcome"]["success"] == 5

    @pytest.mark.parametrize("status", [401, 403])
    async def test_a_rejected_server_key_names_its_variable(
        self, aiohttp_server: Any, dataset: Path, tmp_path: Path, status: int
    ) -> None:
        """A key the rollout server refuses is reported as rejected, naming the variable
        it came from (not as a missing key), and leaves no run directory."""
        server = await aiohttp_server(refusing_app("/health", status), host="127.0.0.1")
        url = str(server.make_url("")).rstrip("/")
        key = EnvKey("wrong", env_name="ROLLOUT_KEY")
        with pytest.raises(ServerUnavailableError) as caught:
            await run_eval(
                options(dataset, tmp_path, server_url=url, server_api_key=key),
                stream=io.StringIO(),
            )
        message = str(caught.value)
        assert f"the rollout server at {url} rejected the key in $ROLLOUT_KEY ({status})" in message
        assert "requires an API key" not in message
        assert not (tmp_path / "out").exists()

    async def test_a_missing_server_key_asks_for_one(
        self, aiohttp_server: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Without a key, a 401 says the server requires one and how to pass it."""
        server = await aiohttp_server(refusing_app("/health", 401), host="127.0.0.1")
        url = str(server.make_url("")).rstrip("/")
        with pytest.raises(ServerUnavailableError, match=r"requires an API key \(401\); pass "):
            await run_eval(options(dataset, tmp_path, server_url=url), stream=io.StringIO())

    @pytest.mark.parametrize("status", [401, 403])
    async def test_a_rejected_model_key_is_named_in_the_warning(
        self, aiohttp_server: Any, fakes: Any, dataset: Path, tmp_path: Path, status: int
    ) -> None:
        """A chat endpoint that refuses the key on GET /models gets a warning naming the
        status and the key's variable, not "did not list any model"."""
        chat = await aiohttp_server(refusing_app("/v1/models", status), host="127.0.0.1")
        server = fakes.FakeServer(by_label({}))
        stream = io.StringIO()
        await run_eval(
            options(
                dataset,
                tmp_path,
                chat_url=str(chat.make_url("/v1")),
                llm_api_key=EnvKey("wrong", env_name="VLLM_API_KEY"),
            ),
            stream=stream,
            client_factory=server.factory,
        )
        text = stream.getvalue()
        assert (
            f"/v1/models answered {status}: the model endpoint rejected the key in $VLLM_API_KEY"
            in text
        )
        assert "did not list any model" not in text

    async def test_a_model_endpoint_that_needs_a_key_says_so(
        self, aiohttp_server: Any, fakes: Any, dataset: Path, tmp_path: Path
    ) -> None:
        """Without --llm-api-key-env, a 401 on GET /models says a key is needed and how."""
        chat = await aiohttp_server(refusing_app("/v1/models", 401), host="127.0.0.1")
        server = fakes.FakeServer(by_label({}))
        stream = io.StringIO()
        await run_eval(
            options(dataset, tmp_path, chat_url=str(chat.make_url("/v1"))),
            stream=stream,
            client_factory=server.factory,
        )
        assert "needs an API key and none was given; pass --llm-api-key-env" in stream.getvalue()


class TestClassify:
    def test_capacity_from_health(self) -> None:
        """Capacity comes from max_queue_depth, else concurrency.max_concurrent, else None."""
        assert capacity_from_health({"max_queue_depth": 7}) == 7
        assert capacity_from_health({"concurrency": {"max_concurrent": 4}}) == 4
        assert capacity_from_health({"concurrency": {"max_concurrent": None}}) is None
        assert capacity_from_health({"status": "ok"}) is None

    def test_unknown_category_is_not_scored(self) -> None:
        """A failure category from a newer server is an infra failure, not a zero."""
        result = RolloutResultResponse(
            rollout_id="r", status="failure", err_category="quota_exceeded", err_message="q"
        )
        assert classify_result(result).outcome == "infra_failure"

    def test_cancelled_is_not_recorded(self) -> None:
        """A cancelled rollout has no outcome (the item stays pending)."""
        result = RolloutResultResponse(rollout_id="r", status="cancelled")
        assert classify_result(result).outcome is None
