"""rollout-eval end to end: the real client against the example rollout server and the chat
stand-in (subprocesses on loopback), and against small misbehaving protocol servers."""

from __future__ import annotations

import asyncio
import importlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_client.eval import EvalOptions, read_journal, run_eval
from rollout_client.eval._cli import main as eval_main

from .conftest import Watched

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "examples" / "datasets" / "arithmetic.jsonl"


def load_demo() -> ModuleType:
    """Import tools/demo.py (the process helpers of the demo) with ``tools/`` on sys.path."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    return importlib.import_module("demo")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The chat stand-in (no wrong answers, 60 ms per call) and the example rollout server."""
    demo = load_demo()
    workdir = tmp_path_factory.mktemp("servers")
    with demo.demo_servers(workdir, error_rate=0.0, latency_ms=60.0, stream=False) as (
        chat_url,
        server_url,
        _processes,
    ):
        yield chat_url, server_url


def small_dataset(path: Path) -> Path:
    """Eight demo questions; rows 2 and 5 carry a wrong label so their reward is 0."""
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()[:8]]
    for index in (2, 5):
        rows[index]["label"] = str(int(rows[index]["label"]) + 1)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def deterministic(summary: dict[str, Any]) -> dict[str, Any]:
    """The parts of a summary that do not depend on timing."""
    keep = ("items", "by_outcome", "by_status", "by_err_category", "reward", "pass", "pass_at_k")
    return {key: summary[key] for key in keep}


def eval_command(dataset: Path, server_url: str, chat_url: str, output: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout_client.eval",
        "run",
        str(dataset),
        "--server",
        server_url,
        "--chat-url",
        chat_url,
        "--output",
        str(output),
        "--name",
        "resumed",
        "--n",
        "2",
        "--concurrency",
        "2",
        "--progress",
        "plain",
    ]


class TestEvalAgainstExampleServer:
    async def test_small_dataset_runs_to_a_complete_summary(
        self, servers: tuple[str, str], tmp_path: Path
    ) -> None:
        """Every item of a small dataset is graded by the example grader; wrong labels score 0."""
        chat_url, server_url = servers
        report = await run_eval(
            EvalOptions(
                dataset=small_dataset(tmp_path / "small.jsonl"),
                server_url=server_url,
                chat_url=chat_url,
                output=tmp_path / "out",
                progress="off",
            ),
            stream=io.StringIO(),
        )
        assert report.exit_code == 0
        summary = report.summary
        assert summary["complete"] is True
        assert summary["by_outcome"]["success"] == 8
        assert summary["pass"]["passed"] == 6
        assert summary["reward"]["mean"] == pytest.approx(0.75)
        assert summary["run"]["chat_models"] == ["chat-standin"]
        samples = [
            json.loads(line) for line in (report.run_dir / "samples.jsonl").read_text().splitlines()
        ]
        tool_messages = [m for s in samples for m in s["messages"] if m["role"] == "tool"]
        assert len(tool_messages) == 8

    def test_run_with_report_writes_the_report_of_the_run(
        self, servers: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """run --report prints the summary and the report's path; the report has every item."""
        chat_url, server_url = servers
        dataset = small_dataset(tmp_path / "small.jsonl")
        command = eval_command(dataset, server_url, chat_url, tmp_path / "out")
        assert eval_main([*command[3:], "--report"]) == 0
        report = tmp_path / "out" / "resumed" / "report.html"
        assert capsys.readouterr().out.endswith(f"report: {report}\n")
        document = report.read_text(encoding="utf-8")
        for row in range(8):
            for run in range(2):
                assert f'id="item-{row}-{run}"' in document
        assert "calculator" in document
        assert "pass@2" in document

    def test_resume_after_interrupt_continues_and_matches_uninterrupted_run(
        self, servers: tuple[str, str], tmp_path: Path
    ) -> None:
        """Ctrl-C leaves items pending (exit 130); re-running finishes only those, same summary."""
        chat_url, server_url = servers
        dataset = small_dataset(tmp_path / "small.jsonl")
        reference = asyncio.run(
            run_eval(
                EvalOptions(
                    dataset=dataset,
                    server_url=server_url,
                    chat_url=chat_url,
                    output=tmp_path / "ref",
                    n=2,
                    concurrency=2,
                    progress="off",
                ),
                stream=io.StringIO(),
            )
        )
        output = tmp_path / "out"
        journal = output / "resumed" / "events.jsonl"
        command = eval_command(dataset, server_url, chat_url, output)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        try:
            deadline = time.monotonic() + 60
            while not journal.exists() or len(journal.read_bytes().splitlines()) < 3:
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "no 3 results within 60 s"
                time.sleep(0.02)
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
        assert process.returncode == 130, err
        assert "stay pending" in err
        interrupted = read_journal(journal)
        assert 3 <= len(interrupted) < 16
        done_before = {record.item for record in interrupted}

        resumed = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert resumed.returncode == 0, resumed.stderr
        assert f"{len(done_before)} of 16 items done" in resumed.stderr
        records = read_journal(journal)
        new_items = [record.item for record in records[len(interrupted) :]]
        assert not set(new_items) & done_before
        assert len(new_items) == 16 - len(done_before)
        summary = json.loads((output / "resumed" / "summary.json").read_text())
        assert deterministic(summary) == deterministic(reference.summary)
        assert "pass rate" in resumed.stdout


class TestDatasetErrors:
    def test_bad_rows_are_reported_with_file_line_and_field(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Invalid rows stop the run before any rollout, each named by file, line and field."""
        bad = tmp_path / "bad.jsonl"
        bad.write_text(
            '{"user_prompt": "What is 1 + 1?", "label": "2"}\n'
            '{"user_prompt": "What is 2 + 2?", "answer": "4"}\n'
            "{not json}\n"
            '{"user_prompt": 7, "label": "7"}\n'
            '{"user_prompt": "x", "label": "1", "metadata": "[1, 2]"}\n'
        )
        status = eval_main(
            [
                "run",
                str(bad),
                "--server",
                "http://127.0.0.1:9",
                "--chat-url",
                "http://127.0.0.1:9/v1",
                "--output",
                str(tmp_path / "out"),
            ]
        )
        err = capsys.readouterr().err
        assert status == 2
        assert f"{bad}:2: field 'label': is missing" in err
        assert "rename it" in err
        assert f"{bad}:3: not valid JSON" in err
        assert f"{bad}:4: field 'user_prompt': must be a string" in err
        assert f"{bad}:5: field 'metadata': must be a JSON object" in err
        assert not (tmp_path / "out").exists()

    def test_bad_csv_rows_name_their_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A CSV row with a bad metadata cell is reported with its line number."""
        bad = tmp_path / "bad.csv"
        bad.write_text('user_prompt,label,metadata\n"What is 1+1?",2,\nWhat?,3,"{oops"\n')
        status = eval_main(
            ["run", str(bad), "--server", "http://127.0.0.1:9", "--chat-url", "http://x/v1"]
        )
        assert status == 2
        assert f"{bad}:3: field 'metadata': is a string but not valid JSON" in (
            capsys.readouterr().err
        )


def protocol_server(
    behaviour: dict[str, str],
    *,
    admitted: asyncio.Event | None = None,
    cancelled: list[str] | None = None,
    cancel_seen: asyncio.Event | None = None,
) -> web.Application:
    """A minimal rollout server whose results depend on the request label.

    ``ok``: success, reward 1; ``zero``: success, reward 0; ``lease``: the lease-expired
    failure; ``drop``: every result poll's connection is closed without an answer;
    ``hang``: ``running`` forever, cancel requests are acknowledged but ignored.
    ``admitted`` is set at the first admission; ``cancelled`` collects cancelled ids and
    ``cancel_seen`` is set at the first cancel request.
    """
    leases: dict[str, tuple[str, str]] = {}

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "concurrency": {"max_concurrent": 2, "queued": 0, "running": 0},
                "process_id": "p",
                "instance_id": "p",
                "lifecycle": {"accepting_rollouts": True, "active_rollouts": 0},
            }
        )

    async def admit(request: web.Request) -> web.Response:
        body = await request.json()
        token = secrets.token_urlsafe(16)
        leases[body["rollout_id"]] = (token, behaviour[body["label"]])
        if admitted is not None:
            admitted.set()
        return web.json_response(
            {
                "rollout_id": body["rollout_id"],
                "status": "queued",
                "polling_lease_token": token,
                "result_wait_timeout_sec": 1.0,
                "polling_lease_timeout_sec": 3.0,
            },
            status=202,
        )

    async def result(request: web.Request) -> web.StreamResponse:
        rollout_id = request.match_info["rollout_id"]
        token, kind = leases[rollout_id]
        assert request.headers["X-Osmosis-Rollout-Lease"] == token
        if kind == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if kind == "hang":
            await asyncio.sleep(0.2)
            return web.json_response({"rollout_id": rollout_id, "status": "running"})
        if kind == "lease":
            return web.json_response(
                {
                    "rollout_id": rollout_id,
                    "status": "failure",
                    "sample": None,
                    "err_message": "polling lease expired",
                    "err_category": "lease_expired",
                }
            )
        sample = {
            "messages": [{"role": "assistant", "content": "done"}],
            "label": None,
            "reward": 1.0 if kind == "ok" else 0.0,
            "remove_sample": False,
            "metrics": {},
            "extra_fields": {},
        }
        return web.json_response(
            {
                "rollout_id": rollout_id,
                "status": "success",
                "sample": sample,
                "err_message": None,
                "err_category": None,
            }
        )

    async def cancel(request: web.Request) -> web.Response:
        ids = (await request.json())["ids"]
        if cancelled is not None:
            cancelled.extend(ids)
        if cancel_seen is not None:
            cancel_seen.set()
        return web.json_response({"dispositions": dict.fromkeys(ids, "cancelled_running")})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/rollout", admit)
    app.router.add_get("/rollout/{rollout_id}/result", result)
    app.router.add_post("/rollout/cancel", cancel)
    return app


def labelled(path: Path, labels: list[str]) -> Path:
    path.write_text("".join(json.dumps({"user_prompt": "q", "label": lb}) + "\n" for lb in labels))
    return path


class TestInfrastructureFailures:
    async def test_lease_expired_and_transport_failures_are_failures_not_zeros(
        self, aiohttp_server: Any, tmp_path: Path
    ) -> None:
        """lease_expired and dropped connections are infra failures: pending, never scored."""
        server = await aiohttp_server(
            protocol_server({"ok": "ok", "zero": "zero", "lease": "lease", "drop": "drop"}),
            host="127.0.0.1",
        )
        report = await run_eval(
            EvalOptions(
                dataset=labelled(tmp_path / "d.jsonl", ["ok", "zero", "lease", "drop"]),
                server_url=str(server.make_url("")).rstrip("/"),
                chat_url="http://127.0.0.1:9/v1",
                output=tmp_path / "out",
                progress="off",
            ),
            stream=io.StringIO(),
        )
        records = {r.row_index: r for r in read_journal(report.run_dir / "events.jsonl")}
        assert records[2].outcome == "infra_failure"
        assert records[2].err_category == "lease_expired"
        assert records[2].reward is None
        assert records[3].outcome == "infra_failure"
        assert records[3].err_category == "transport_error"
        summary = report.summary
        assert summary["reward"] == {**summary["reward"], "count": 2, "mean": 0.5}
        assert summary["pass"] == {**summary["pass"], "passed": 1, "scored": 2}
        assert summary["by_outcome"]["infra_failure"] == 2
        assert summary["items"]["pending"] == 2
        assert report.exit_code == 1

    async def test_consecutive_transport_failures_stop_the_run_early(
        self, aiohttp_server: Any, tmp_path: Path
    ) -> None:
        """With every poll dropped the run stops after the configured number in a row."""
        server = await aiohttp_server(protocol_server({"drop": "drop"}), host="127.0.0.1")
        report = await run_eval(
            EvalOptions(
                dataset=labelled(tmp_path / "d.jsonl", ["drop"] * 10),
                server_url=str(server.make_url("")).rstrip("/"),
                chat_url="http://127.0.0.1:9/v1",
                output=tmp_path / "out",
                concurrency=1,
                max_consecutive_infra_failures=3,
                progress="off",
            ),
            stream=io.StringIO(),
        )
        assert len(read_journal(report.run_dir / "events.jsonl")) == 3
        assert report.stop_reason is not None
        assert "3 consecutive infrastructure failures" in report.stop_reason
        assert "transport_error" in report.stop_reason
        assert report.summary["items"]["pending"] == 10


async def read_until(stream: asyncio.StreamReader, marker: bytes) -> bytes:
    """Read lines from ``stream`` until one contains ``marker``; return what was read."""
    seen = b""
    while marker not in seen:
        line = await stream.readline()
        assert line, f"stream ended before {marker!r}; got {seen!r}"
        seen += line
    return seen


class TestInterrupts:
    async def test_second_interrupt_exits_at_once(
        self, aiohttp_server: Any, tmp_path: Path
    ) -> None:
        """Ctrl-C cancels in-flight rollouts on the server; a second Ctrl-C exits 130 at once."""
        admitted, cancel_seen = asyncio.Event(), asyncio.Event()
        cancelled: list[str] = []
        server = await aiohttp_server(
            protocol_server(
                {"hang": "hang"}, admitted=admitted, cancelled=cancelled, cancel_seen=cancel_seen
            ),
            host="127.0.0.1",
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollout_client.eval",
            "run",
            str(labelled(tmp_path / "d.jsonl", ["hang", "hang"])),
            "--server",
            str(server.make_url("")).rstrip("/"),
            "--chat-url",
            "http://127.0.0.1:9/v1",
            "--output",
            str(tmp_path / "out"),
            "--progress",
            "plain",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(60):
                assert process.stderr is not None
                await read_until(process.stderr, b"rollouts to run")
                await admitted.wait()
                process.send_signal(signal.SIGINT)
                await read_until(process.stderr, b"press Ctrl-C again")
                await cancel_seen.wait()
                process.send_signal(signal.SIGINT)
                _, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 130
        assert b"interrupted twice: exited at once" in err
        assert cancelled


def gated_chat(gates: list[asyncio.Event], both: asyncio.Event) -> web.Application:
    """A chat endpoint that answers "The answer is 2.": the first two requests once their
    gate (``gates[0]``, ``gates[1]``) is set, later ones at once; ``both`` is set when the
    first two wait."""
    arrived = 0

    async def completions(_request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived <= len(gates):
            if arrived == len(gates):
                both.set()
            await gates[arrived - 1].wait()
        message = {"role": "assistant", "content": "The answer is 2."}
        return web.json_response(
            {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    return app


class TestServerShutdown:
    async def test_sigterm_to_the_server_drains_the_run(
        self, aiohttp_server: Any, tmp_path: Path
    ) -> None:
        """SIGTERM to the rollout server while two rollouts run: when one finishes the next
        admission gets 503, rollout-eval starts no new rollout, still collects and records
        the one in flight (the server finishes it), ends with the closing line and exit 1,
        and the server exits 0."""
        demo = load_demo()
        gates, both = [asyncio.Event(), asyncio.Event()], asyncio.Event()
        chat = await aiohttp_server(gated_chat(gates, both), host="127.0.0.1")
        server = demo.ManagedProcess(
            "rollout-server",
            [
                *demo._script("rollout-server"),
                "serve",
                demo.BACKEND_TARGET,
                "--app-dir",
                str(demo.EXAMPLES),
                "--port",
                "0",
                "--port-file",
                str(tmp_path / "server.port"),
                "--drain-timeout-sec",
                "60",
                "--log-level",
                "WARNING",
            ],
            log_path=tmp_path / "server.log",
            env={
                **os.environ,
                "ROLLOUT_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
                "EXAMPLE_AGENT_MODEL": "m",
            },
        )
        loop = asyncio.get_running_loop()
        stream = Watched("the rollout server is shutting down")
        try:
            port = await loop.run_in_executor(
                None, lambda: server.wait_for_port(port_file=tmp_path / "server.port")
            )
            server_url = f"http://127.0.0.1:{port}"
            run = asyncio.ensure_future(
                run_eval(
                    EvalOptions(
                        dataset=labelled(tmp_path / "d.jsonl", ["2"] * 6),
                        server_url=server_url,
                        chat_url=str(chat.make_url("/v1")),
                        output=tmp_path / "out",
                        concurrency=2,
                        progress="off",
                    ),
                    stream=stream,
                )
            )
            async with asyncio.timeout(60):
                await both.wait()  # two rollouts in flight, held by the chat endpoint
                server.terminate()
                async with aiohttp.ClientSession() as session:
                    while True:
                        async with session.get(f"{server_url}/health") as response:
                            health = await response.json()
                        if not health["lifecycle"]["accepting_rollouts"]:
                            break
                gates[1].set()  # one finishes; its worker's next admission gets 503
                await stream.seen.wait()
                gates[0].set()  # the other, still in flight, finishes during the drain
                report = await run
        finally:
            stopped = await loop.run_in_executor(None, server.stop)
        assert stopped == (0, False), server.log_tail()
        records = read_journal(report.run_dir / "events.jsonl")
        assert [(r.outcome, r.reward) for r in records] == [("success", 1.0), ("success", 1.0)]
        assert report.exit_code == 1
        assert report.summary["items"]["pending"] == 4
        assert report.closing_line == (
            "rollout-eval: the rollout server is shutting down (it answered 503 to a new "
            "rollout); 4 items pending. Re-run the same command to resume."
        )
        assert "cancelling" not in stream.getvalue()
