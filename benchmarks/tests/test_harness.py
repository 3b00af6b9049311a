"""The benchmark harness: planning, statistics, record checks, and a tiny end-to-end run.

Nothing here is timed: the tiny runs exercise every workload's code path and check that
what the suite writes is well-formed, never how fast anything was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from benchmarks.processes import ServerProcess
from benchmarks.report import Target, floor_table, rows_for, summary_records, validate_record
from benchmarks.stats import percentile, summarize
from benchmarks.suite import FLOOR, FULL, POOL_SHAPES, QUICK, TINY, plan_runs

ROOT = Path(__file__).resolve().parents[2]
OSMOSIS_PYTHON_ENV = "ROLLOUT_INTEROP_OSMOSIS_PYTHON"
RUN_BOUND_SEC = 300


def run_module(module: str, *args: str) -> str:
    """Run ``python -m <module> *args`` from the repository root; return its stdout."""
    completed = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_SEC,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


def run_suite(out_dir: Path, *args: str) -> list[dict[str, Any]]:
    """Run ``python -m benchmarks --profile tiny *args`` and return the records it wrote."""
    run_module("benchmarks", "--profile", "tiny", "--out-dir", str(out_dir), *args)
    lines = (out_dir / "latest.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line) for line in lines]


def assert_well_formed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every record passes the schema check and every run succeeded; return the runs."""
    problems = {i: validate_record(r) for i, r in enumerate(records) if validate_record(r)}
    assert problems == {}
    assert records[0]["type"] == "meta"
    runs = [r for r in records if r["type"] == "run"]
    assert [r for r in runs if not r["ok"]] == []
    assert all(r["failed"] == 0 and r["succeeded"] == r["count"] for r in runs)
    return runs


class TestPercentile:
    def test_interpolates_between_ranks(self) -> None:
        """The median of an even-sized sample lies halfway between the middle two."""
        assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5

    def test_extremes_are_min_and_max(self) -> None:
        """Fractions 0 and 1 give the smallest and the largest value."""
        assert (percentile([3.0, 1.0, 2.0], 0.0), percentile([3.0, 1.0, 2.0], 1.0)) == (1.0, 3.0)

    def test_rejects_empty_and_out_of_range(self) -> None:
        """No values, or a fraction outside [0, 1], is a ValueError."""
        with pytest.raises(ValueError, match="no values"):
            percentile([], 0.5)
        with pytest.raises(ValueError, match="within"):
            percentile([1.0], 1.5)

    def test_summarize_reports_median_min_max(self) -> None:
        """Repetitions summarise as median, min, max and their count."""
        assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


class TestPlanRuns:
    def test_full_plan_covers_every_workload(self) -> None:
        """The full suite plans 3 repetitions of every run, with 10,000 in flight for ours only."""
        runs = plan_runs(
            FULL, ("throughput", "notify", "inflight", "cpu", "cross"), ("ours", "osmosis")
        )
        assert len([r for r in runs if r.workloads[0] == "throughput"]) == 3 * 3 * 2
        assert len([r for r in runs if "cpu" in r.workloads]) == 3 * 2
        assert sorted({(r.client, r.server, r.count) for r in runs if r.shape == "inflight"}) == [
            ("osmosis", "osmosis", 5000),
            ("ours", FLOOR, 5000),
            ("ours", "ours", 5000),
            ("ours", "ours", 10000),
        ]
        assert {(r.client, r.server) for r in runs if r.workloads == ("cross",)} == {
            ("ours", "osmosis"),
            ("osmosis", "ours"),
        }

    def test_stacks_alternate_between_repetitions(self) -> None:
        """Ours runs first in even repetitions and osmosis first in odd ones."""
        runs = plan_runs(FULL, ("throughput",), ("ours", "osmosis"))
        firsts = [r.client for r in runs if r.concurrency == 1]
        assert firsts == ["ours", "osmosis", "osmosis", "ours", "ours", "osmosis"]

    def test_notify_runs_staggered_and_lockstep(self) -> None:
        """The notification workload runs each stack with staggered and lockstep starts."""
        runs = plan_runs(FULL, ("notify",), ("ours",))
        assert [r.stagger_sec for r in runs] == [FULL.notify_sleep_sec, 0.0] * 3

    def test_cpu_alone_gets_its_own_runs(self) -> None:
        """Without a throughput run at its concurrency, the CPU workload plans its own."""
        runs = plan_runs(QUICK, ("cpu",), ("ours",))
        assert [(r.workloads, r.concurrency) for r in runs] == [(("cpu",), 512)]

    def test_floor_runs_only_with_our_stack(self) -> None:
        """The HTTP floor is driven by our client, so it runs only when ours is selected."""
        servers = [r.server for r in plan_runs(TINY, ("inflight",), ("osmosis", "ours"))]
        assert servers == ["osmosis", "ours", FLOOR]
        assert [r.server for r in plan_runs(TINY, ("inflight",), ("osmosis",))] == ["osmosis"]

    def test_pool_runs_with_our_stack_only(self) -> None:
        """The pool workload runs our client, then our pool over one and two servers, each
        at the pool concurrency; it is left out without our stack."""
        runs = plan_runs(FULL, ("pool",), ("ours", "osmosis"))
        assert [(r.pool, r.servers) for r in runs] == list(POOL_SHAPES) * FULL.repetitions
        assert {(r.client, r.server, r.concurrency, r.count) for r in runs} == {
            ("ours", "ours", 64, FULL.pool_count)
        }
        assert plan_runs(FULL, ("pool",), ("osmosis",)) == []

    def test_pool_run_passes_every_server_to_the_load_generator(self) -> None:
        """A pool run's load generator gets each server's URL and PID, and --pool."""
        (_, _, two) = plan_runs(TINY, ("pool",), ("ours",))
        args = two.loadgen_args(urls=["http://a", "http://b"], server_pids=[1, 2], loop="auto")
        joined = " ".join(args)
        assert "--url http://a --server-pid 1 --url http://b --server-pid 2 --pool" in joined
        assert two.label == "pool-ours-ours-c3-pool2-r0"

    def test_cross_needs_both_stacks(self) -> None:
        """Cross pairs are left out when only one stack is selected."""
        assert plan_runs(TINY, ("cross",), ("ours",)) == []

    def test_rejects_unknown_names(self) -> None:
        """An unknown workload or stack is a ValueError naming the choices."""
        with pytest.raises(ValueError, match="unknown workload"):
            plan_runs(TINY, ("latency",), ("ours",))
        with pytest.raises(ValueError, match="unknown stack"):
            plan_runs(TINY, ("cpu",), ("vllm",))


class TestTarget:
    def test_ratio_targets_compare_ours_over_osmosis(self) -> None:
        """A minimum ratio is met at or above it, a maximum at or below it."""
        cell = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
        assert Target(kind="ratio_min", value=4.0, text="").met(cell, 4.0) is True
        assert Target(kind="ratio_max", value=0.25, text="").met(cell, 0.3) is False
        assert Target(kind="ratio_max", value=0.25, text="").met(cell, None) is None

    def test_zero_target_needs_every_repetition(self) -> None:
        """A zero target fails when any repetition had a non-zero value."""
        cell = {"median": 0.0, "min": 0.0, "max": 2.0, "n": 3}
        assert Target(kind="zero", value=0.0, text="").met(cell, None) is False


def inflight_run(server: str, rss_kib: float, client: str = "ours") -> dict[str, Any]:
    """A minimal in-flight run record: who ran it and its RSS figure."""
    return {
        "workloads": ["inflight"],
        "client": client,
        "server": server,
        "count": TINY.inflight_counts["ours"][0],
        "error": None,
        "rss_per_inflight_kib": rss_kib,
    }


class TestFloorReport:
    def test_summaries_keep_floor_and_cross_runs_apart(self) -> None:
        """Floor runs (our client) feed the floor's cells, never ours; a mixed pair feeds
        neither stack."""
        rows = [r for r in rows_for(TINY, ("inflight",)) if r.metric == "rss_per_inflight_kib"]
        runs = [
            inflight_run("ours", 15.0),
            inflight_run(FLOOR, 11.0),
            inflight_run("ours", 99.0, client="osmosis"),
        ]
        cells = {s["stack"]: s["median"] for s in summary_records(rows, runs, ("ours", FLOOR))}
        assert cells == {"ours": 15.0, FLOOR: 11.0}

    def test_floor_table_shows_what_ours_adds(self) -> None:
        """The floor table puts ours next to the floor with the difference; without floor
        figures there is no table."""
        rows = rows_for(TINY, ("inflight",))
        runs = [inflight_run("ours", 15.5), inflight_run(FLOOR, 11.25)]
        table = floor_table(rows, summary_records(rows, runs, ("ours", FLOOR)))
        assert table is not None
        assert "| server RSS KiB per in-flight rollout (6) | 11.2 | 15.5 | 4.25 |" in table
        assert floor_table(rows, summary_records(rows, runs[:1], ("ours", FLOOR))) is None


class TestValidateRecord:
    def test_reports_missing_and_mistyped_figures(self) -> None:
        """A closed-loop run without its figures, or with NaN, is reported as malformed."""
        record = {
            "type": "run",
            "workloads": ["throughput"],
            "client": "ours",
            "server": "ours",
            "shape": "closed",
            "repetition": 0,
            "count": 1,
            "ok": True,
            "error": None,
            "rollouts_per_sec": float("nan"),
        }
        problems = validate_record(record)
        assert "missing 'completed'" in problems
        assert any(p.startswith("'rollouts_per_sec'") for p in problems)

    def test_errored_run_needs_only_its_spec(self) -> None:
        """A run that failed to produce figures is well-formed with its spec and error."""
        record = {
            "type": "run",
            "workloads": ["cpu"],
            "client": "ours",
            "server": "ours",
            "shape": "closed",
            "repetition": 0,
            "count": 1,
            "ok": False,
            "error": "server did not start",
        }
        assert validate_record(record) == []


class TestTinySuite:
    def test_every_workload_on_our_stack(self, tmp_path: Path) -> None:
        """A tiny run of every workload against our stack writes well-formed records and tables."""
        records = run_suite(tmp_path, "--stacks", "ours")
        runs = assert_well_formed(records)
        assert {w for r in runs for w in r["workloads"]} == {
            "throughput",
            "notify",
            "inflight",
            "cpu",
            "pool",
        }
        assert {r["rollouts_per_sec"] > 0 for r in runs if r["shape"] == "closed"} == {True}
        assert {r["admitted"] for r in runs if r["shape"] == "inflight"} == {
            TINY.inflight_counts["ours"][0]
        }
        assert {r["server"] for r in runs if r["shape"] == "inflight"} == {"ours", FLOOR}
        summaries = [r for r in records if r["type"] == "summary"]
        assert {s["stack"] for s in summaries} == {"ours", FLOOR}
        table = (tmp_path / "latest.md").read_text("utf-8")
        assert "| workload | metric | ours | osmosis-ai 0.3.8 |" in table
        assert "| our client, in flight | bare aiohttp (floor) | ours |" in table
        pool_runs = [r for r in runs if r["workloads"] == ["pool"]]
        assert [(r["pool"], r["servers"]) for r in pool_runs] == list(POOL_SHAPES)
        assert "| RolloutClientPool → 2 servers |" in table

    def test_ours_serve_args_reach_the_server_and_the_report(self, tmp_path: Path) -> None:
        """``--ours-serve-arg`` and ``--state`` are recorded with the figures and named in the
        table, and our server gets them: with ``--no-metrics`` it has no ``/metrics``; with
        ``--state sqlite`` each run records its server's group-commit figures."""
        records = run_suite(
            tmp_path,
            "--stacks",
            "ours",
            "--workload",
            "throughput",
            "--ours-serve-arg=--no-metrics",
            "--state",
            "sqlite",
        )
        runs = assert_well_formed(records)
        assert records[0]["ours_serve_args"] == ["--no-metrics"]
        assert records[0]["state"] == "sqlite"
        for run in runs:
            assert run["server_state"]["store"] == "sqlite"
            assert run["server_state"]["writes"] >= run["count"]
            assert 1 <= run["server_state"]["largest_commit"] <= run["server_state"]["writes"]
        table = (tmp_path / "latest.md").read_text("utf-8")
        assert "`rollout-server serve --state sqlite --no-metrics`" in table
        answers = {}
        for args in ((), ("--no-metrics",)):
            with ServerProcess(
                stack="ours", python=sys.executable, log_path=tmp_path / "s.log", serve_args=args
            ) as server:
                try:
                    url = f"{server.url}/metrics"  # http://127.0.0.1:<port>
                    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310
                        answers[args] = reply.status
                except urllib.error.HTTPError as error:
                    answers[args] = error.code
        assert answers == {(): 200, ("--no-metrics",): 404}

    def test_paired_runs_two_configurations_side_by_side(self) -> None:
        """``benchmarks.paired`` drives both servers in alternating batches and reports
        each one's rate and CPU per rollout and the per-pair CPU ratio."""
        stdout = run_module(
            "benchmarks.paired",
            "--rounds",
            "2",
            "--batch",
            "4",
            "--warmup",
            "2",
            "--b-arg=--no-metrics",
        )
        report = json.loads(stdout)
        assert (report["a_args"], report["b_args"]) == ([], ["--no-metrics"])
        assert {len(values) for values in report["cpu_ms_per_batch"].values()} == {2}
        for figure in ("rollouts_per_sec", "server_cpu_ms_per_rollout"):
            assert set(report[figure]) == {"a", "b"}
            assert report[figure]["a"]["min"] <= report[figure]["a"]["median"]
        assert set(report["cpu_ratio_a_over_b"]) <= {"median", "min", "max"}

    @pytest.mark.osmosis
    def test_both_stacks_and_cross_pairs(self, tmp_path: Path) -> None:
        """With the osmosis-ai venv, both stacks and both cross pairs run and give ratios."""
        python = os.environ.get(OSMOSIS_PYTHON_ENV, "").strip()
        if not python:
            pytest.skip(f"{OSMOSIS_PYTHON_ENV} is not set (the osmosis-ai 0.3.8 venv's python)")
        records = run_suite(
            tmp_path, "--osmosis-python", python, "--workload", "throughput", "--workload", "cross"
        )
        runs = assert_well_formed(records)
        assert {(r["client"], r["server"]) for r in runs} == {
            ("ours", "ours"),
            ("osmosis", "osmosis"),
            ("ours", "osmosis"),
            ("osmosis", "ours"),
        }
