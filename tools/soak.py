#!/usr/bin/env python3
"""The chaos soak of issue 28 ("a restart loses nothing"): ``nox -s soak`` (by hand, 500
items) and ``nox -s soak_short`` (CI, about 60 s of chaos).

It starts, on 127.0.0.1:

1. the chat stand-in (``tools/chat_standin/server.py``) answering ``--http-500-rate`` of its
   requests (default 5%) with HTTP 500;
2. ``rollout-server serve`` with the example calculator agent on a SQLite state file;
3. ``rollout-eval run`` over the example dataset (rows repeated with ``--n`` until there are
   ``--items`` items), as a subprocess;

and, while ``--chaos-sec`` lasts, SIGKILLs the rollout server (by its PID) every
``--restart-every-sec`` and starts it again on the same port and state file. A
``rollout-eval run`` that ends with items pending (rollouts the restarts failed, or a run the
stop rule ended) is run again, which resumes it, at most ``--max-passes`` times. Then it reads
the run's ``events.jsonl`` and checks that every item has exactly one final outcome (success,
failed or skipped), none lost and none recorded twice, and prints its figures: restarts,
Ray worker kills, results reloaded (retained results, collected or not), rollouts
re-attached (RayBackend) and rollouts failed by the restarts (the restarted servers'
``/health``), items retried (recorded as an infrastructure failure, then run again), eval
passes, elapsed.

With ``--ray`` it first starts a Ray head on 127.0.0.1 (``tools/raycluster.py``: ``ray start
--head --block`` with a temporary directory of its own) and serves the example Ray backend
(``calculator_agent.ray_backend``, ``--ray-workers`` workers) joined to it, so the workers
are named, detached actors that outlive each SIGKILL of the server and are re-attached by
the next one; and, while the chaos lasts, it SIGKILLs one Ray worker (by the PID the
server's ``/health`` ``ray.pool`` names, checked to be a process of that cluster) every
``--worker-kill-every-sec``, in turn. At the end it stops the server (SIGTERM: its workers
go with it), then the head, and fails when a process of the cluster outlived that. Without
``--ray`` the server runs LocalBackend and no worker is killed.

Every process is stopped by its own PID; every wait is bounded. Exit status 0 when the
check holds, 1 when it does not (or a process misbehaved).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from demo import BACKEND_TARGET, DATASET, EXAMPLES, ROOT, STANDIN, _script
from devprocs import ManagedProcess, ProcessError, child_env
from raycluster import LocalRayHead

RAY_BACKEND_TARGET: Final = "calculator_agent.ray_backend:create_backend"

FINAL_OUTCOMES: Final = frozenset({"success", "failed", "skipped"})
EVAL_PASS_TIMEOUT_SEC: Final = 900.0
"""Bound on one ``rollout-eval run`` pass."""
HEALTH_TIMEOUT_SEC: Final = 5.0
TICK_SEC: Final = 0.1
START_TIMEOUT_SEC: Final = 120.0
"""Bound on one start of the rollout server (with ``--ray``: joining Ray, re-attaching)."""


def fetch_health(url: str) -> dict[str, Any]:
    """``GET /health`` of the rollout server (bounded)."""
    address = f"{url}/health"  # always http://127.0.0.1:PORT, built here
    with urllib.request.urlopen(address, timeout=HEALTH_TIMEOUT_SEC) as answer:  # noqa: S310
        document: dict[str, Any] = json.loads(answer.read())
        return document


class Server:
    """The rollout server: started on a port file, SIGKILLed and restarted on its port."""

    def __init__(
        self,
        workdir: Path,
        *,
        latency_args: Sequence[str],
        ray: LocalRayHead | None = None,
        ray_workers: int = 2,
    ) -> None:
        self.workdir = workdir
        self.ray = ray
        self.ray_workers = ray_workers
        self.state = f"sqlite://{workdir / 'state.db'}"
        self.port = 0
        self.starts = 0
        self.extra = list(latency_args)
        self.process = self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> ManagedProcess:
        port_file = self.workdir / "server.port"
        port_file.unlink(missing_ok=True)
        env = {
            "ROLLOUT_ARTIFACT_ROOT": str(self.workdir / "trajectories"),
            "EXAMPLE_AGENT_STREAM": "0",
        }
        if self.ray is not None:
            env |= {
                **self.ray.env,
                "RAY_ADDRESS": self.ray.address,
                "EXAMPLE_RAY_WORKERS": str(self.ray_workers),
            }
        process = ManagedProcess(
            "rollout-server",
            [
                *_script("rollout-server"),
                "serve",
                BACKEND_TARGET if self.ray is None else RAY_BACKEND_TARGET,
                "--app-dir",
                EXAMPLES,
                "--host",
                "127.0.0.1",
                "--port",
                self.port,
                "--port-file",
                port_file,
                "--state",
                self.state,
                "--log-level",
                "WARNING",
                *self.extra,
            ],
            log_path=self.workdir / "server.log",
            append=True,
            env=child_env(env, drop=("RAY_AUTH_TOKEN",)),
            cwd=ROOT,
        )
        self.port = process.wait_for_port(port_file=port_file, timeout_sec=START_TIMEOUT_SEC)
        self.starts += 1
        return process

    def kill_and_restart(self) -> dict[str, Any]:
        """SIGKILL the server by its PID, start it again on the same port and state file;
        return the new process's ``state`` figures from ``/health``."""
        self.process.stop(signal_number=signal.SIGKILL)
        self.process = self._start()
        state: dict[str, Any] = fetch_health(self.url).get("state", {})
        return state

    def kill_worker(self, turn: int) -> int | None:
        """SIGKILL one Ray worker, by the PID ``/health`` names (worker ``turn`` modulo the
        pool, among those alive), after checking it is a process of the soak's cluster.

        Returns:
            The PID killed, or None when no worker could be (none listed, or the server
            did not answer).
        """
        assert self.ray is not None
        try:
            pool = fetch_health(self.url).get("ray", {}).get("pool", [])
        except OSError:
            return None
        pids = [entry["pid"] for entry in pool if isinstance(entry.get("pid"), int)]
        if not pids:
            return None
        pid: int = pids[turn % len(pids)]
        if not self.ray.owns(pid):
            raise ProcessError(f"/health names worker pid {pid}, not a process of the soak's Ray")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return pid

    def stop(self) -> int:
        """SIGTERM, bounded; the exit status."""
        return self.process.stop().status


def run_pass(
    args: argparse.Namespace, workdir: Path, chat_url: str, server_url: str, n: int
) -> ManagedProcess:
    """Start one ``rollout-eval run`` pass (it resumes the run when it exists)."""
    return ManagedProcess(
        "rollout-eval",
        [
            *_script("rollout-eval"),
            "run",
            DATASET,
            "--server",
            server_url,
            "--chat-url",
            chat_url,
            "--output",
            workdir / "runs",
            "--name",
            "soak",
            "--n",
            n,
            "--concurrency",
            args.concurrency,
            "--progress",
            "plain",
            "--progress-interval-sec",
            "10",
        ],
        log_path=workdir / "eval.log",
        append=True,
        env=child_env(),
        cwd=ROOT,
    )


def check_journal(path: Path, expected: set[tuple[int, int]]) -> tuple[list[str], dict[str, int]]:
    """Every expected item has exactly one final outcome, none is lost or duplicated.

    Returns:
        The problems found (empty when the check holds) and the counts of the run.
    """
    by_item: defaultdict[tuple[int, int], list[str]] = defaultdict(list)
    infra_categories: Counter[str] = Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "outcome" not in record:
            continue  # a header or marker line
        by_item[(record["row_index"], record["run_index"])].append(record["outcome"])
        if record["outcome"] == "infra_failure":
            infra_categories[record.get("err_category") or "none"] += 1
    problems: list[str] = []
    for item in sorted(expected):
        outcomes = by_item.get(item, [])
        finals = [o for o in outcomes if o in FINAL_OUTCOMES]
        if len(finals) != 1:
            problems.append(f"item {item}: {len(finals)} final outcomes ({outcomes})")
        elif outcomes[-1] not in FINAL_OUTCOMES:
            problems.append(f"item {item}: a record after its final outcome ({outcomes})")
    unexpected = sorted(set(by_item) - expected)
    if unexpected:
        problems.append(f"records for items outside the run: {unexpected[:5]}")
    final = Counter(o for outcomes in by_item.values() for o in outcomes if o in FINAL_OUTCOMES)
    counts = {
        **{f"final {name}": final[name] for name in sorted(FINAL_OUTCOMES)},
        "items retried": sum(1 for o in by_item.values() if "infra_failure" in o),
        "infra failures recorded": sum(infra_categories.values()),
        **{f"  {name}": count for name, count in sorted(infra_categories.items())},
    }
    return problems, counts


def soak(args: argparse.Namespace) -> int:
    workdir: Path = args.workdir.resolve()  # the state URL needs an absolute path
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("state.db", "state.db-wal", "state.db-shm", "eval.log", "server.log"):
        (workdir / stale).unlink(missing_ok=True)
    rows = sum(1 for line in DATASET.read_text().splitlines() if line.strip())
    n = max(1, -(-args.items // rows))
    expected = {(row, run) for row in range(rows) for run in range(n)}
    started = time.monotonic()
    standin_port = workdir / "standin.port"
    standin_port.unlink(missing_ok=True)
    standin = ManagedProcess(
        "chat stand-in",
        [
            sys.executable,
            STANDIN,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            standin_port,
            "--http-500-rate",
            args.http_500_rate,
            "--error-rate",
            "0.1",
            "--latency-ms",
            args.latency_ms,
        ],
        log_path=workdir / "standin.log",
        env=child_env(),
        cwd=ROOT,
    )
    server: Server | None = None
    evaluation: ManagedProcess | None = None
    head: LocalRayHead | None = None
    restarts: list[dict[str, Any]] = []
    worker_kills: list[int] = []
    ray_strays: list[str] = []
    passes = 0
    try:
        chat_url = f"http://127.0.0.1:{standin.wait_for_port(port_file=standin_port)}/v1"
        if args.ray:
            head = LocalRayHead(workdir / "ray.log", num_cpus=args.ray_workers)
            print(f"soak: Ray head at {head.address} (temp dir {head.temp_dir})", flush=True)
        server = Server(workdir, latency_args=(), ray=head, ray_workers=args.ray_workers)
        chaos_until = time.monotonic() + args.chaos_sec
        next_restart = time.monotonic() + args.restart_every_sec
        next_worker_kill = time.monotonic() + args.worker_kill_every_sec
        while passes < args.max_passes:
            passes += 1
            evaluation = run_pass(args, workdir, chat_url, server.url, n)
            pass_deadline = time.monotonic() + EVAL_PASS_TIMEOUT_SEC
            while evaluation.poll() is None and time.monotonic() < pass_deadline:
                now = time.monotonic()
                if now >= next_restart and now < chaos_until:
                    state = server.kill_and_restart()
                    restarts.append(state)
                    print(
                        f"soak: restart {len(restarts)} at {now - started:.1f} s: reloaded "
                        f"{state.get('recovered_rollouts')} result(s), re-attached "
                        f"{state.get('reattached_rollouts', 0)}, failed "
                        f"{state.get('failed_by_restart')} in flight",
                        flush=True,
                    )
                    next_restart = time.monotonic() + args.restart_every_sec
                if head is not None and now >= next_worker_kill and now < chaos_until:
                    pid = server.kill_worker(len(worker_kills))
                    if pid is not None:
                        worker_kills.append(pid)
                        print(
                            f"soak: Ray worker kill {len(worker_kills)} at "
                            f"{now - started:.1f} s: pid {pid}",
                            flush=True,
                        )
                    next_worker_kill = time.monotonic() + args.worker_kill_every_sec
                time.sleep(TICK_SEC)
            status = evaluation.stop(timeout_sec=30.0).status
            evaluation = None
            print(f"soak: eval pass {passes} exited with status {status}", flush=True)
            if status == 0:
                break
        server_status = server.stop()
        server = None
        if head is not None:
            ray_strays = head.stop()
            head = None
        elapsed = time.monotonic() - started
    finally:
        if evaluation is not None:
            evaluation.stop()
        if server is not None:
            server.stop()
        if head is not None:
            head.stop()
        standin.stop()
    problems, counts = check_journal(workdir / "runs" / "soak" / "events.jsonl", expected)
    figures = {
        "items": len(expected),
        "server restarts (SIGKILL)": len(restarts),
        "backend": "RayBackend" if args.ray else "LocalBackend",
        "Ray worker kills (SIGKILL)": len(worker_kills),
        "results reloaded by restarts": sum(s.get("recovered_rollouts", 0) for s in restarts),
        "rollouts re-attached by restarts": sum(s.get("reattached_rollouts", 0) for s in restarts),
        "rollouts failed by restarts": sum(s.get("failed_by_restart", 0) for s in restarts),
        **counts,
        "eval passes": passes,
        "elapsed (s)": round(elapsed, 1),
        "chat 500 rate": args.http_500_rate,
        "restart every (s)": args.restart_every_sec,
        "worker kill every (s)": args.worker_kill_every_sec if args.ray else None,
        "chaos (s)": args.chaos_sec,
        "concurrency": args.concurrency,
    }
    print("soak figures:")
    for name, value in figures.items():
        print(f"  {name:34} {value}")
    (workdir / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    if len(restarts) < args.min_restarts:
        problems.append(f"only {len(restarts)} restart(s); --min-restarts is {args.min_restarts}")
    if args.ray and len(worker_kills) < args.min_worker_kills:
        problems.append(
            f"only {len(worker_kills)} Ray worker kill(s); --min-worker-kills is "
            f"{args.min_worker_kills}"
        )
    if ray_strays:
        problems.append(
            f"{len(ray_strays)} process(es) of the soak's Ray outlived its stop (SIGKILLed): "
            + "; ".join(ray_strays[:3])
        )
    if server_status != 0:
        problems.append(f"the last rollout server exited with status {server_status} on SIGTERM")
    if problems:
        print("soak: FAILED:\n  " + "\n  ".join(problems[:20]))
        return 1
    print(f"soak: OK: every one of the {len(expected)} items has exactly one outcome")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=500, help="items at least (default 500)")
    parser.add_argument("--concurrency", type=int, default=8, help="default 8")
    parser.add_argument(
        "--min-restarts", type=int, default=1, help="fail with fewer restarts (default 1)"
    )
    parser.add_argument(
        "--restart-every-sec", type=float, default=20.0, help="SIGKILL period (default 20)"
    )
    parser.add_argument(
        "--chaos-sec", type=float, default=3600.0, help="restarts stop after this (default 3600)"
    )
    parser.add_argument("--http-500-rate", type=float, default=0.05, help="default 0.05")
    parser.add_argument(
        "--latency-ms", type=float, default=500.0, help="chat latency (default 500)"
    )
    parser.add_argument("--max-passes", type=int, default=10, help="eval passes (default 10)")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="serve the example Ray backend on a Ray head of its own (127.0.0.1) and SIGKILL "
        "a Ray worker every --worker-kill-every-sec (needs rollout-server[ray])",
    )
    parser.add_argument(
        "--ray-workers", type=int, default=2, help="Ray workers (and head CPUs; default 2)"
    )
    parser.add_argument(
        "--worker-kill-every-sec",
        type=float,
        default=15.0,
        help="with --ray: Ray worker SIGKILL period (default 15)",
    )
    parser.add_argument(
        "--min-worker-kills",
        type=int,
        default=1,
        help="with --ray: fail with fewer worker kills (default 1)",
    )
    parser.add_argument(
        "--workdir", type=Path, default=ROOT / ".rollout-eval" / "soak", help="scratch directory"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ray_workers < 1:
        parser.error(f"--ray-workers must be at least 1, not {args.ray_workers}")
    if args.worker_kill_every_sec <= 0:
        parser.error(f"--worker-kill-every-sec must be positive, not {args.worker_kill_every_sec}")
    try:
        return soak(args)
    except ProcessError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
