"""``osmosis eval run`` (osmosis-ai 0.3.8's evaluation CLI) against ``rollout-server serve``.

The test lays out a workspace as osmosis-ai expects one (a git worktree with ``rollouts/``,
``configs/eval/``, ``configs/training/`` and ``data/``) whose rollout entrypoint starts our
server with the example calculator agent (``examples/calculator_agent``). osmosis-ai launches
it as it launches its own rollout servers: ``uv sync`` of the rollout project, then ``uv run``
of the entrypoint with ``_OSMOSIS_ROLLOUT_PORT``, ``_OSMOSIS_ROLLOUT_ARTIFACT_ROOT`` and
``_OSMOSIS_ROLLOUT_INSTANCE_ID`` set. Its LiteLLM bridge forwards the agent's chat completions
to the test's stand-in, which calls the calculator tool before it answers, so every saved
conversation has a tool call and its result.

After each result osmosis-ai waits (up to 30 s) for ``trajectory.json`` to be an ATIF
document of that rollout; the run must show no such wait, and osmosis-ai's own readers must
accept every file (the reader the runner polls with, and the upload plan, which validates
each trajectory strictly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from pathlib import Path
from typing import Any, Final

import pytest
from interop_harness import OSMOSIS, OURS_SERVER, ChatStandIn, python_of
from interop_harness.peers import REMOTE_DIR
from interop_harness.processes import STOP_TIMEOUT_SEC, peer_env

pytestmark = pytest.mark.osmosis

ROOT: Final = Path(__file__).resolve().parents[2]
ROWS: Final = 6
ROUTE: Final = "eval"
"""The stand-in's id for every completion: the bridge sends them all to one base URL."""
RUN_NAME: Final = "interop-run"
EVAL_RUN_TIMEOUT_SEC: Final = 600.0
"""Bound on the whole run: imports (LiteLLM), ``uv sync`` of the rollout project (PyPI, or
uv's cache), server start and the rows. A stalled run (30 s per row) fits in it too, so the
test reports the stall rather than a timeout."""
INTERRUPT_GRACE_SEC: Final = 60.0
"""After a timeout: how long the CLI gets to stop its server after SIGINT."""
ARCHIVE_STALL: Final = "no parseable trajectory within the archive grace period"
"""osmosis-ai's log line after 30 s without a valid trajectory for a finished rollout."""


def make_workspace(root: Path, server_python: str) -> Path:
    """An osmosis-ai workspace whose rollout ``calc`` serves the example calculator agent."""
    workspace = root / "workspace"
    for folder in ("rollouts/calc", "configs/eval", "configs/training", "data"):
        (workspace / folder).mkdir(parents=True)
    # osmosis-ai finds the workspace as the git worktree it is run in.
    subprocess.run(["git", "init", "--quiet"], cwd=workspace, check=True, timeout=60)
    (workspace / "configs" / "eval" / "calc.toml").write_text(
        "[experiment]\n"
        'rollout = "calc"\n'
        'entrypoint = "main.py"\n'
        'model_path = "openai/interop"\n'
        'dataset = "arithmetic"\n'
        "\n"
        "[evaluation]\n"
        "agent_workflow_timeout_s = 120\n"
        "grader_timeout_s = 60\n"
        "\n"
        "[env]\n"
        'EXAMPLE_AGENT_MODEL = "interop"\n'
        "\n"
        "[secrets]\n"
        "required = []\n"
    )
    # osmosis-ai starts the entrypoint through a bootstrap that imports FastAPI (it marks
    # FastAPI's /health), so the rollout project needs it although our server does not.
    (workspace / "rollouts" / "calc" / "pyproject.toml").write_text(
        "[project]\n"
        'name = "calc"\n'
        'version = "0.1.0"\n'
        'requires-python = ">=3.11"\n'
        'dependencies = ["fastapi"]\n'
    )
    argv = [
        server_python, "-m", "rollout_server", "serve", "calculator_agent.backend:create_backend",
        "--app-dir", str(ROOT / "examples"), "--host", "127.0.0.1",
    ]  # fmt: skip
    (workspace / "rollouts" / "calc" / "main.py").write_text(
        '"""Serve the calculator agent with rollout-server (port and the rest from the\n'
        '_OSMOSIS_ROLLOUT_* variables osmosis-ai sets)."""\n\n'
        "import os\n\n"
        f"ARGV = {argv!r}\n"
        "os.execv(ARGV[0], ARGV)\n"
    )
    questions = ["2 + 2", "8 / 2", "1 + 3", "2 * 2", "7 - 3", "16 / 4"]
    (workspace / "data" / "arithmetic.jsonl").write_text(
        "".join(
            json.dumps({"user_prompt": f"What is {question}?", "label": "4"}) + "\n"
            for question in questions[:ROWS]
        )
    )
    return workspace


async def run_osmosis_eval(osmosis_python: str, workspace: Path, env: dict[str, str]) -> str:
    """Run ``osmosis eval run`` to its end (bounded); return its output.

    On a timeout the CLI gets SIGINT (it cancels its rollouts and stops the server it
    started), then SIGKILL after :data:`INTERRUPT_GRACE_SEC`.
    """
    osmosis = str(Path(osmosis_python).with_name("osmosis"))
    process = await asyncio.create_subprocess_exec(
        osmosis, "--plain", "eval", "run", "configs/eval/calc.toml",
        "--dataset-file", "data/arithmetic.jsonl", "--name", RUN_NAME,
        "--output", str(workspace / "evals"), "--yes",
        cwd=workspace,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with asyncio.timeout(EVAL_RUN_TIMEOUT_SEC):
            output, _ = await process.communicate()
    except TimeoutError:
        process.send_signal(signal.SIGINT)
        try:
            async with asyncio.timeout(INTERRUPT_GRACE_SEC):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            async with asyncio.timeout(STOP_TIMEOUT_SEC):
                await process.wait()
        pytest.fail(f"osmosis eval run did not finish within {EVAL_RUN_TIMEOUT_SEC} s")
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    return text


def osmosis_readers(osmosis_python: str, run_dir: Path) -> dict[str, Any]:
    """What osmosis-ai's own readers make of the run (``remote/osmosis_eval_check.py``)."""
    completed = subprocess.run(
        [osmosis_python, str(REMOTE_DIR / "osmosis_eval_check.py"), str(run_dir)],
        env=peer_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report: dict[str, Any] = json.loads(completed.stdout)
    return report


class TestOsmosisEvalRun:
    async def test_trajectories_are_read_without_waiting(
        self, tmp_path: Path, standin: ChatStandIn
    ) -> None:
        """Every row succeeds with its tool-calling conversation saved as a trajectory that
        osmosis-ai finds at once (no archive wait) and its readers and upload accept."""
        osmosis_python = python_of(OSMOSIS)
        workspace = make_workspace(tmp_path, python_of(OURS_SERVER))
        standin.call_tool(ROUTE, "calculator", {"expression": "2 + 2"})
        env = peer_env(
            {
                "OPENAI_API_KEY": "interop-llm-key",
                "OPENAI_API_BASE": f"{standin.base_url}/v1/rollouts/{ROUTE}",
                # LiteLLM would fetch its model price map from the internet on import.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                # uv builds the rollout project's environment on the peer's Python, never
                # on a downloaded one.
                "UV_PYTHON": osmosis_python,
                "UV_PYTHON_DOWNLOADS": "never",
            },
            # The server must write where osmosis-ai tells it (_OSMOSIS_ROLLOUT_ARTIFACT_ROOT,
            # the run's rollout_trials); the session's ROLLOUT_ARTIFACT_ROOT (the root
            # conftest's) would win over that.
            drop=frozenset({"ROLLOUT_ARTIFACT_ROOT"}),
        )
        output = await run_osmosis_eval(osmosis_python, workspace, env)

        # uv made the rollout project's own environment (never the test venv's).
        assert (workspace / "rollouts" / "calc" / ".venv").is_dir()
        run_dir = workspace / "evals" / RUN_NAME
        rows = [json.loads(line) for line in (run_dir / "index.jsonl").read_text().splitlines()]
        assert len(rows) == ROWS, output
        assert [(row["status"], row["reward"]) for row in rows] == [("success", 1.0)] * ROWS
        # The runner lists a row's trajectory once it has read a valid one for it.
        assert all(row.get("trajectory_filename") == "trajectory.json" for row in rows), rows
        logs = (run_dir / "logs.txt").read_text()
        assert ARCHIVE_STALL not in logs
        assert len(list((run_dir / "trajectories").glob("row_*_run_0.json"))) == ROWS

        for row in rows:
            rollout_id = row["rollout_id"]
            path = run_dir / "rollout_trials" / rollout_id / "trajectory.json"
            document = json.loads(path.read_text())
            assert document["schema_version"] == "ATIF-v1.7"
            assert document["session_id"] == document["trajectory_id"] == rollout_id
            osmosis_extra = document["extra"]["osmosis"]
            assert (osmosis_extra["rollout_id"], osmosis_extra["reward"]) == (rollout_id, 1.0)
            assert osmosis_extra["request_extra_fields"] == {
                "row_index": row["row_index"],
                "run_index": 0,
            }
            acting = [step for step in document["steps"] if step.get("tool_calls")]
            assert len(acting) == 1, document["steps"]
            (tool_call,) = acting[0]["tool_calls"]
            assert tool_call["function_name"] == "calculator"
            assert tool_call["arguments"] == {"expression": "2 + 2"}
            (result,) = acting[0]["observation"]["results"]
            assert result["source_call_id"] == tool_call["tool_call_id"]
            assert document["steps"][-1] == {
                "step_id": len(document["steps"]),
                "source": "agent",
                "message": "4",
            }

        report = osmosis_readers(osmosis_python, run_dir)
        assert report["accepted"] == {row["rollout_id"]: True for row in rows}
        assert "upload_error" not in report, report
        assert {f"rollout_trials/{row['rollout_id']}/trajectory.json" for row in rows} <= set(
            report["upload_files"]
        )
