"""RayBackend re-attach (issue 28, item 3): a real ``rollout-server serve`` with RayBackend on
a SQLite state file joins the session's Ray cluster (127.0.0.1), so its workers are named,
detached actors that outlive the server process. SIGKILL of the server leaves them running;
the restarted server (same state, same port) re-attaches, collects what finished meanwhile
and waits for the rest; only rollouts whose worker died too fail by the restart. A clean
(SIGTERM) shutdown leaves no detached worker behind. In process: a named worker lost while
the server runs is replaced under its name.

Workflows wait for a release file the test writes and mark their start and end with files:
the test waits on those (bounded), never on timing.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any, Final

import aiohttp
import pytest

from rollout_server import AgentWorkflow, AgentWorkflowOutput, RayBackend, WorkflowContext
from rollout_types import LEASE_HEADER

ray = pytest.importorskip("ray")

from rollout_server.ray._backend import state_namespace  # noqa: E402 - after the skip

from .cli_helpers import Served, serve_target  # noqa: E402 - after the skip

COMMAND_LOOP_ONLY = True
"""Run these tests once (see conftest): the servers under test have their own loop."""

START_SEC: Final = 90.0
"""Bound on a server's start-up (imports, joining Ray, starting workers on 2 loaded cores)."""
EVENT_SEC: Final = 60.0
LISTENING: Final = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")
ROLLOUTS: Final = 10

TARGET_MODULE: Final = '''
"""RayBackend of the re-attach tests: each rollout writes started-<id> (with its worker's
pid) into metadata["dir"], waits until release-<id> exists there, writes finished-<id>
and answers; $REATTACH_WORKERS (default two) workers of 8 slots, joining the cluster at
$RAY_ADDRESS."""

import asyncio
import os
import sys
from pathlib import Path

import ray

from rollout_server import AgentWorkflow, AgentWorkflowConfig, Grader, RayBackend


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ReleasedWorkflow(AgentWorkflow):
    async def run(self, ctx):
        directory = Path(ctx.metadata["dir"])
        (directory / f"started-{ctx.rollout_id}").write_text(str(os.getpid()))
        while not (directory / f"release-{ctx.rollout_id}").exists():
            await asyncio.sleep(0.05)
        (directory / f"finished-{ctx.rollout_id}").write_text("")
        return [*ctx.prompt, {"role": "assistant", "content": "42"}]


class FullMarks(Grader):
    async def grade(self, ctx):
        ctx.set_reward(1.0)


backend = RayBackend(
    ReleasedWorkflow,
    workflow_config=AgentWorkflowConfig(name="reattach", concurrency={"max_concurrent": 8}),
    grader=FullMarks,
    num_workers=int(os.environ.get("REATTACH_WORKERS", "2")),
    worker_options={"num_cpus": 0},
    cancel_grace_sec=2.0,
)
'''


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("reattach-targets")
    (directory / "reattach_targets.py").write_text(textwrap.dedent(TARGET_MODULE))
    return directory


def serve(app_dir: Path, cluster: Any, *args: str, env: dict[str, str] | None = None) -> Any:
    """Serve ``reattach_targets:backend`` joining ``cluster``, with short shutdown stages
    (stopped by its PID)."""
    return serve_target(
        app_dir,
        "reattach_targets:backend",
        *("--result-wait-timeout-sec", "1", "--drain-timeout-sec", "0"),
        *("--cleanup-timeout-sec", "5", "--collect-timeout-sec", "0"),
        *args,
        env={
            "RAY_ADDRESS": cluster.address,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            **(env or {}),
        },
        start_sec=START_SEC,
        exit_sec=EVENT_SEC,
    )


def named_workers(namespace: str) -> list[str]:
    """The named actors alive in ``namespace``."""
    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == namespace
    )


async def until_files(directory: Path, prefix: str, rollout_ids: list[str]) -> None:
    """Wait (bounded) until ``<prefix>-<id>`` exists for every id."""
    async with asyncio.timeout(EVENT_SEC):
        while True:
            if all((directory / f"{prefix}-{rid}").exists() for rid in rollout_ids):
                return
            await asyncio.sleep(0.05)


async def admit(session: aiohttp.ClientSession, url: str, rollout_id: str, work: Path) -> str:
    body = {
        "initial_messages": [{"role": "user", "content": "6 x 7?"}],
        "rollout_id": rollout_id,
        "chat_completions_url": "http://127.0.0.1:9/v1",
        "metadata": {"dir": str(work)},
    }
    async with session.post(f"{url}/rollout", json=body) as response:
        assert response.status == 202, await response.text()
        token: str = (await response.json())["polling_lease_token"]
        return token


async def health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/health") as response:
        assert response.status == 200
        document: dict[str, Any] = await response.json()
        return document


async def result(
    session: aiohttp.ClientSession, url: str, rollout_id: str, token: str
) -> dict[str, Any]:
    """Poll with ``token`` until the result is terminal (bounded)."""
    async with asyncio.timeout(EVENT_SEC):
        while True:
            async with session.get(
                f"{url}/rollout/{rollout_id}/result", headers={LEASE_HEADER: token}
            ) as response:
                assert response.status == 200, await response.text()
                body: dict[str, Any] = await response.json()
            if body["status"] in ("success", "failure", "cancelled"):
                return body


async def sigkill(served: Served) -> None:
    served.process.send_signal(signal.SIGKILL)  # by its PID
    assert await served.exit_status() == -signal.SIGKILL


async def until_gone(namespace: str, names: list[str]) -> None:
    async with asyncio.timeout(EVENT_SEC):
        while True:
            if not set(names) & set(named_workers(namespace)):
                return
            await asyncio.sleep(0.05)


class QuickWorkflow(AgentWorkflow):
    async def run(self, ctx: WorkflowContext) -> AgentWorkflowOutput:
        return AgentWorkflowOutput(messages=[*ctx.prompt, {"role": "assistant", "content": "42"}])


class TestNamedWorkersInProcess:
    async def test_a_named_worker_lost_while_serving_is_replaced_under_its_name(
        self, make_harness: Any, ray_cluster: Any, tmp_path: Path
    ) -> None:
        """On durable state with a joined cluster, a named worker SIGKILLed while the
        server runs is replaced by one of the same name (once Ray frees it), which
        serves; the backend's shutdown kills it (no detached actor is left)."""
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        state = f"sqlite://{tmp_path / 'state.db'}"
        namespace = state_namespace(state)
        backend = RayBackend(
            QuickWorkflow,
            address=ray_cluster.address,
            worker_options={"num_cpus": 0},
            artifact_root=tmp_path,
        )
        harness = await make_harness(backend, state=state)
        assert named_workers(namespace) == ["rollout-worker-0"]
        assert (await harness.health()).json["ray"]["namespace"] == namespace
        (worker,) = (await harness.health()).json["ray"]["pool"]
        os.kill(worker["pid"], signal.SIGKILL)
        async with asyncio.timeout(EVENT_SEC):
            while True:
                fields = (await harness.health()).json["ray"]
                if fields["replaced"] == 1 and fields["workers_alive"] == 1:
                    break
                await asyncio.sleep(0.05)
        assert fields["pool"][0]["pid"] != worker["pid"]
        assert named_workers(namespace) == ["rollout-worker-0"]
        token = await harness.admit("a", grade=False)
        reply = await harness.poll_until("a", token, "success", "failure", "cancelled")
        assert reply.json["status"] == "success", reply.json
        assert reply.json["sample"]["messages"][-1]["content"] == "42"
        await backend.shutdown()
        assert named_workers(namespace) == []

    async def test_memory_state_keeps_anonymous_workers(
        self, make_harness: Any, ray_cluster: Any, tmp_path: Path
    ) -> None:
        """With memory: state nothing survives a restart, so even on a joined cluster the
        workers stay anonymous actors of the server process."""
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        before = ray.util.list_named_actors(all_namespaces=True)
        backend = RayBackend(
            QuickWorkflow,
            address=ray_cluster.address,
            worker_options={"num_cpus": 0},
            artifact_root=tmp_path,
        )
        harness = await make_harness(backend, state="memory:")
        fields = (await harness.health()).json["ray"]
        assert (fields["namespace"], fields["workers_alive"]) == (None, 1)
        assert ray.util.list_named_actors(all_namespaces=True) == before


class TestReattach:
    async def test_restart_while_ten_rollouts_run_finishes_all_as_success(
        self,
        app_dir: Path,
        ray_cluster: Any,
        session: aiohttp.ClientSession,
        tmp_path: Path,
    ) -> None:
        """10 rollouts run on 2 workers; the server is SIGKILLed; 5 finish while it is down;
        the restarted server re-attaches, and the original tokens collect 10 successes (the
        5 collected from the workers, the 5 it waited for); a SIGTERM then leaves no named
        worker behind."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        namespace = state_namespace(state)
        work = tmp_path / "work"
        work.mkdir()
        ids = [f"r-{i}" for i in range(ROLLOUTS)]
        with serve(app_dir, ray_cluster, "--port", "0", "--state", state) as first:
            await first.listening()
            port = first.port
            tokens = {rid: await admit(session, first.url, rid, work) for rid in ids}
            await until_files(work, "started", ids)
            assert named_workers(namespace) == ["rollout-worker-0", "rollout-worker-1"]
            await sigkill(first)
        # Half finish while no server runs; the workers keep their outcomes.
        for rid in ids[:5]:
            (work / f"release-{rid}").write_text("")
        await until_files(work, "finished", ids[:5])
        assert named_workers(namespace) == ["rollout-worker-0", "rollout-worker-1"]

        with serve(app_dir, ray_cluster, "--port", str(port), "--state", state) as second:
            await second.listening()
            assert second.port == port
            # Collected (finished while down) or waited for again: all 10 re-attached.
            counts = re.search(
                r"(\d+) rollout\(s\) finished meanwhile, (\d+) still running", second.output
            )
            assert counts is not None, second.output
            assert int(counts.group(1)) + int(counts.group(2)) == ROLLOUTS
            assert "was started with another workflow" not in second.output
            document = await health(session, second.url)
            assert document["state"]["reattached_rollouts"] == ROLLOUTS
            assert document["state"]["failed_by_restart"] == 0
            assert document["ray"]["workers_alive"] == 2
            assert document["ray"]["lost"] == 0
            for rid in ids[5:]:
                (work / f"release-{rid}").write_text("")
            bodies = await asyncio.gather(
                *(result(session, second.url, rid, tokens[rid]) for rid in ids)
            )
            for body in bodies:
                assert (body["status"], body["err_message"]) == ("success", None)
                assert body["sample"]["reward"] == 1.0
            second.process.send_signal(signal.SIGTERM)
            assert await second.exit_status() == 0
        assert named_workers(namespace) == []

    async def test_rollouts_of_a_worker_that_died_while_down_fail_by_the_restart(
        self,
        app_dir: Path,
        ray_cluster: Any,
        session: aiohttp.ClientSession,
        tmp_path: Path,
    ) -> None:
        """A worker killed while no server runs takes its rollouts with it: they fail as
        internal_error naming the restart and the worker; the other worker's rollouts
        finish as success, and a replacement takes the dead worker's place."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        namespace = state_namespace(state)
        work = tmp_path / "work"
        work.mkdir()
        ids = [f"w-{i}" for i in range(4)]
        with serve(app_dir, ray_cluster, "--port", "0", "--state", state) as first:
            await first.listening()
            port = first.port
            tokens = {rid: await admit(session, first.url, rid, work) for rid in ids}
            await until_files(work, "started", ids)
            pool = (await health(session, first.url))["ray"]["pool"]
            killed_process_id = (await health(session, first.url))["process_id"]
            await sigkill(first)
        pid_of_worker_0 = next(entry["pid"] for entry in pool if entry["index"] == 0)
        on_worker_0 = [
            rid for rid in ids if (work / f"started-{rid}").read_text() == str(pid_of_worker_0)
        ]
        assert on_worker_0
        assert len(on_worker_0) < len(ids)
        ray.kill(ray.get_actor("rollout-worker-0", namespace=namespace), no_restart=True)
        await until_gone(namespace, ["rollout-worker-0"])

        with serve(app_dir, ray_cluster, "--port", str(port), "--state", state) as second:
            await second.listening()
            document = await health(session, second.url)
            assert document["state"]["failed_by_restart"] == len(on_worker_0)
            assert document["state"]["reattached_rollouts"] == len(ids) - len(on_worker_0)
            assert document["ray"]["workers_alive"] == 2
            for rid in ids:
                (work / f"release-{rid}").write_text("")
            for rid in ids:
                body = await result(session, second.url, rid, tokens[rid])
                if rid in on_worker_0:
                    assert body["status"] == "failure"
                    assert body["err_category"] == "internal_error"
                    assert body["err_message"] == (
                        f"the server process {killed_process_id} ended before the rollout "
                        "finished; Ray worker(s) 0 of the pool ended while it was down, and "
                        "no live worker holds the rollout"
                    )
                else:
                    assert body["status"] == "success"
            second.process.send_signal(signal.SIGTERM)
            assert await second.exit_status() == 0
        assert named_workers(namespace) == []

    async def test_a_smaller_pool_stops_the_extra_worker_and_fails_only_its_rollouts(
        self,
        app_dir: Path,
        ray_cluster: Any,
        session: aiohttp.ClientSession,
        tmp_path: Path,
    ) -> None:
        """Restarted with num_workers=1, the server stops worker 1 (beyond its size): the
        rollouts there fail by the restart saying so; worker 0's finish as success."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        namespace = state_namespace(state)
        work = tmp_path / "work"
        work.mkdir()
        ids = [f"s-{i}" for i in range(4)]
        with serve(app_dir, ray_cluster, "--port", "0", "--state", state) as first:
            await first.listening()
            port = first.port
            tokens = {rid: await admit(session, first.url, rid, work) for rid in ids}
            await until_files(work, "started", ids)
            pool = (await health(session, first.url))["ray"]["pool"]
            await sigkill(first)
        pid_of_worker_1 = next(entry["pid"] for entry in pool if entry["index"] == 1)
        on_worker_1 = [
            rid for rid in ids if (work / f"started-{rid}").read_text() == str(pid_of_worker_1)
        ]
        assert 0 < len(on_worker_1) < len(ids)

        with serve(
            app_dir,
            ray_cluster,
            "--port",
            str(port),
            "--state",
            state,
            env={"REATTACH_WORKERS": "1"},
        ) as second:
            await second.listening()
            assert named_workers(namespace) == ["rollout-worker-0"]
            for rid in ids:
                (work / f"release-{rid}").write_text("")
            for rid in ids:
                body = await result(session, second.url, rid, tokens[rid])
                if rid in on_worker_1:
                    assert (body["status"], body["err_category"]) == ("failure", "internal_error")
                    assert body["err_message"].endswith(
                        "ended before the rollout finished; 1 Ray worker(s) beyond "
                        "num_workers=1 were stopped at the restart, and no live worker holds "
                        "the rollout"
                    )
                else:
                    assert body["status"] == "success"
            second.process.send_signal(signal.SIGTERM)
            assert await second.exit_status() == 0
        assert named_workers(namespace) == []

    async def test_clean_shutdown_leaves_no_detached_worker(
        self,
        app_dir: Path,
        ray_cluster: Any,
        session: aiohttp.ClientSession,
        tmp_path: Path,
    ) -> None:
        """SIGTERM with a rollout running: the staged shutdown cancels it, and the named,
        detached workers are killed with the pool (only a crash leaves them)."""
        state = f"sqlite://{tmp_path / 'state.db'}"
        namespace = state_namespace(state)
        work = tmp_path / "work"
        work.mkdir()
        with serve(app_dir, ray_cluster, "--port", "0", "--state", state) as served:
            await served.listening()
            await admit(session, served.url, "c-0", work)
            await until_files(work, "started", ["c-0"])
            assert named_workers(namespace) == ["rollout-worker-0", "rollout-worker-1"]
            served.process.send_signal(signal.SIGTERM)
            assert await served.exit_status() == 0
        assert named_workers(namespace) == []
