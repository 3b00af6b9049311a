"""Units behind the server's hot paths: batched file jobs, lease tokens, file writes, logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_server.cli._logsink import TurnBufferedStreamHandler
from rollout_server.execution import _offload
from rollout_server.execution._offload import BatchOffloader
from rollout_server.execution._trajectory import (
    encode_document,
    make_directory,
    write_json_atomic,
    write_rollout_files,
)
from rollout_server.state import _deadlines
from rollout_server.state._deadlines import DeadlineQueue, pending_argument

WAIT_SEC = 5.0


class TestBatchOffloader:
    async def test_jobs_of_one_turn_run_in_order_on_the_loop(self) -> None:
        """Jobs submitted in one turn run in submission order, on the loop's thread, and
        each future gets its own job's value."""
        offloader = BatchOffloader()
        order: list[int] = []
        loop_thread = threading.get_ident()

        def job(n: int) -> tuple[int, int]:
            order.append(n)
            return n, threading.get_ident()

        futures = [offloader.submit(lambda n=n: job(n)) for n in range(5)]
        assert order == []  # nothing runs before the turn ends
        async with asyncio.timeout(WAIT_SEC):
            results = await asyncio.gather(*futures)
        assert order == [0, 1, 2, 3, 4]
        assert results == [(n, loop_thread) for n in range(5)]
        assert not offloader.in_thread_mode

    async def test_a_failing_job_fails_only_its_own_future(self) -> None:
        """An exception reaches the future of the job that raised it; later jobs still run."""
        offloader = BatchOffloader()

        def broken() -> None:
            raise OSError("disk full")

        first = offloader.submit(broken)
        second = offloader.submit(lambda: "ok")
        async with asyncio.timeout(WAIT_SEC):
            with pytest.raises(OSError, match="disk full"):
                await first
            assert await second == "ok"

    async def test_a_cancelled_job_is_skipped(self) -> None:
        """A job whose future is cancelled before its turn does not run."""
        offloader = BatchOffloader()
        ran: list[str] = []
        skipped = offloader.submit(lambda: ran.append("skipped"))
        kept = offloader.submit(lambda: ran.append("kept"))
        skipped.cancel()
        async with asyncio.timeout(WAIT_SEC):
            await kept
        assert ran == ["kept"]

    async def test_a_stalled_job_moves_later_jobs_to_a_worker_thread(self) -> None:
        """After a job slower than ``stall_sec``, the jobs left and later batches run in a
        worker thread, and still deliver their values."""
        offloader = BatchOffloader(stall_sec=0.0, thread_mode_sec=3600.0)
        loop_thread = threading.get_ident()
        first = offloader.submit(threading.get_ident)
        rest = offloader.submit(threading.get_ident)
        async with asyncio.timeout(WAIT_SEC):
            assert await first == loop_thread
            assert offloader.in_thread_mode
            assert await rest != loop_thread
            later = offloader.submit(threading.get_ident)
            failing = offloader.submit(lambda: 1 / 0)
            assert await later != loop_thread
            with pytest.raises(ZeroDivisionError):
                await failing

    async def test_a_hung_thread_batch_fails_its_futures_with_timeout(self) -> None:
        """A batch in a worker thread that outlives ``thread_timeout_sec`` fails its
        unfinished futures with TimeoutError; the thread finishes on its own later."""
        offloader = BatchOffloader(stall_sec=0.0, thread_mode_sec=3600.0, thread_timeout_sec=0.05)
        release = threading.Event()
        finished = threading.Event()

        def hung() -> str:
            release.wait(timeout=WAIT_SEC)
            finished.set()
            return "late"

        async with asyncio.timeout(WAIT_SEC):
            await offloader.submit(lambda: None)  # switches to thread mode
            assert offloader.in_thread_mode
            with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
                await offloader.submit(hung)
            release.set()
            await asyncio.to_thread(finished.wait, WAIT_SEC)
        assert finished.is_set()

    async def test_only_a_majority_of_slow_jobs_moves_to_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Jobs that are slow now and then (a preempted process) stay on the loop; once
        more than half of the last 16 are slow, jobs move to a worker thread. Durations
        come from a fake clock that each job advances."""
        now = [0.0]
        monkeypatch.setattr(_offload.time, "perf_counter", lambda: now[0])
        offloader = BatchOffloader(
            slow_job_sec=0.002, stall_sec=0.1, thread_mode_sec=3600.0, turn_budget_sec=3600.0
        )

        def taking(seconds: float) -> Callable[[], int]:
            def job() -> int:
                now[0] += seconds
                return threading.get_ident()

            return job

        loop_thread = threading.get_ident()
        async with asyncio.timeout(WAIT_SEC):
            # Every fourth job 50 ms (slow, under the stall bound): 4 of every 16.
            occasional = [offloader.submit(taking(0.05 if n % 4 == 0 else 0.0)) for n in range(64)]
            assert set(await asyncio.gather(*occasional)) == {loop_thread}
            assert not offloader.in_thread_mode
            # Sixteen fast jobs, then eight slow ones: 8 of the last 16, not more than half...
            fast_then_slow = [offloader.submit(taking(0.0)) for _ in range(16)]
            fast_then_slow += [offloader.submit(taking(0.005)) for _ in range(8)]
            assert set(await asyncio.gather(*fast_then_slow)) == {loop_thread}
            assert not offloader.in_thread_mode
            # ...the ninth makes 9 of 16: the rest go to a worker thread.
            ninth = offloader.submit(taking(0.005))
            after = offloader.submit(taking(0.0))
            assert await ninth == loop_thread
            assert offloader.in_thread_mode
            assert await after != loop_thread

    async def test_turn_budget_leaves_the_rest_to_later_turns(self) -> None:
        """With no time budget, one job runs per turn and all of them finish, in order."""
        offloader = BatchOffloader(turn_budget_sec=0.0)
        order: list[int] = []
        futures = [offloader.submit(lambda n=n: order.append(n)) for n in range(4)]
        await asyncio.sleep(0)  # the first turn ends: only one job may have run
        assert order == [0]
        async with asyncio.timeout(WAIT_SEC):
            await asyncio.gather(*futures)
        assert order == [0, 1, 2, 3]

    def test_each_loop_starts_afresh(self) -> None:
        """An offloader used on a second event loop runs that loop's jobs (nothing left from
        the first loop blocks it)."""
        offloader = BatchOffloader()

        async def once(value: str) -> str:
            return await offloader.submit(lambda: value)

        assert asyncio.run(once("first")) == "first"
        assert asyncio.run(once("second")) == "second"


class TestDeadlineQueue:
    async def test_due_deadlines_fire_in_order_and_cancelled_ones_never(self) -> None:
        """Deadlines fire in deadline order (not insertion order); a cancelled one never
        fires; each fires once."""
        loop = asyncio.get_running_loop()
        queue = DeadlineQueue()
        fired: list[str] = []
        done = loop.create_future()
        now = loop.time()
        queue.add(loop, now + 0.03, fired.append, "late")
        queue.add(loop, now + 0.01, fired.append, "early")
        dropped = queue.add(loop, now + 0.02, fired.append, "dropped")
        queue.add(loop, now + 0.04, done.set_result, None)
        queue.cancel(dropped)
        queue.cancel(dropped)  # a second cancel changes nothing
        assert len(queue) == 3
        async with asyncio.timeout(WAIT_SEC):
            await done
        assert fired == ["early", "late"]
        assert len(queue) == 0

    async def test_a_deadline_added_by_a_callback_keeps_earlier_ones_on_time(self) -> None:
        """A callback that schedules a far deadline does not delay a nearer one already
        queued."""
        loop = asyncio.get_running_loop()
        queue = DeadlineQueue()
        near = loop.create_future()
        now = loop.time()

        def schedule_far(_argument: object) -> None:
            queue.add(loop, loop.time() + 3600.0, print, "never")

        queue.add(loop, now, schedule_far, None)
        queue.add(loop, now + 0.01, near.set_result, None)
        async with asyncio.timeout(WAIT_SEC):
            await near
        queue.clear()

    async def test_a_failing_callback_is_reported_and_the_rest_run(self) -> None:
        """An exception in one callback goes to the loop's exception handler; deadlines due
        with it still fire."""
        loop = asyncio.get_running_loop()
        queue = DeadlineQueue()
        reported: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        try:
            done = loop.create_future()
            now = loop.time()

            def broken(_argument: object) -> None:
                raise RuntimeError("boom")

            queue.add(loop, now, broken, None)
            queue.add(loop, now, done.set_result, "ran")
            async with asyncio.timeout(WAIT_SEC):
                assert await done == "ran"
        finally:
            loop.set_exception_handler(None)
        assert [type(context["exception"]) for context in reported] == [RuntimeError]

    async def test_bring_forward_moves_only_later_pending_deadlines(self) -> None:
        """bring_forward() replaces a later pending entry with one due at the new time
        (the old one never fires); an entry due by then, or one no longer pending, is
        returned as it is."""
        loop = asyncio.get_running_loop()
        queue = DeadlineQueue()
        fired: list[str] = []
        done = loop.create_future()
        now = loop.time()
        far = queue.add(loop, now + 3600.0, fired.append, "moved")
        near = queue.add(loop, now + 0.01, fired.append, "near")
        moved = queue.bring_forward(loop, far, now + 0.02)
        assert moved is not far
        assert pending_argument(far) is None
        assert pending_argument(moved) == "moved"
        assert queue.bring_forward(loop, near, now + 0.02) is near
        queue.add(loop, now + 0.03, done.set_result, None)
        async with asyncio.timeout(WAIT_SEC):
            await done
        assert fired == ["near", "moved"]
        assert queue.bring_forward(loop, moved, now) is moved  # fired: left as it is
        assert len(queue) == 0

    async def test_many_deadlines_arm_one_loop_timer_for_the_earliest(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A hundred pending deadlines, added in shuffled order (the earliest last), keep
        exactly one loop timer armed, due at the earliest of them; clear() cancels it."""
        loop = asyncio.get_running_loop()
        armed: list[asyncio.TimerHandle] = []
        call_at = loop.call_at

        def recording_call_at(when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
            handle = call_at(when, callback)
            armed.append(handle)
            return handle

        monkeypatch.setattr(loop, "call_at", recording_call_at)
        queue = DeadlineQueue()
        base = loop.time() + 3600.0
        offsets = [(step * 37) % 100 for step in range(1, 101)]  # 0 to 99 s, 0 last
        for offset in offsets:
            queue.add(loop, base + offset, print, offset)
        live = [handle for handle in armed if not handle.cancelled()]
        assert len(queue) == 100
        assert len(live) == 1
        assert live[0].when() == pytest.approx(base, abs=0.01)  # uvloop keeps milliseconds
        queue.clear()
        assert all(handle.cancelled() for handle in armed)

    async def test_cancelled_entries_are_compacted(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Once cancelled entries outnumber live ones (past the minimum), the heap drops
        them and the live deadlines still fire."""
        monkeypatch.setattr(_deadlines, "MIN_COMPACT", 4)
        loop = asyncio.get_running_loop()
        queue = DeadlineQueue()
        far = loop.time() + 3600.0
        entries = [queue.add(loop, far + n, print, n) for n in range(10)]
        done = loop.create_future()
        queue.add(loop, loop.time(), done.set_result, None)
        for entry in entries:
            queue.cancel(entry)
        assert len(queue._heap) < 11
        async with asyncio.timeout(WAIT_SEC):
            await done
        assert len(queue) == 0
        queue.clear()


class TestFileWrites:
    def test_atomic_write_is_owner_only_and_leaves_no_temporary(self, tmp_path: Path) -> None:
        """The written file decodes to the document, ends with a newline, is readable by
        its owner only, and no temporary file is left."""
        target = tmp_path / "doc.json"
        write_json_atomic(target, encode_document({"a": "é", "b": [1, 2]}, "doc"))
        text = target.read_text(encoding="utf-8")
        assert json.loads(text) == {"a": "é", "b": [1, 2]}
        assert text.endswith("\n")
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert [p.name for p in tmp_path.iterdir()] == ["doc.json"]

    def test_leftover_temporary_name_falls_back(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When the process's next temporary name is taken (a leftover), the write still
        succeeds and leaves the leftover alone."""
        import itertools

        from rollout_server.execution import _trajectory as trajectory

        monkeypatch.setattr(trajectory, "_TEMP_SEQUENCE", itertools.count(7))
        leftover = tmp_path / f".doc.json.{os.getpid()}.7.tmp"
        leftover.write_text("stale")
        write_json_atomic(tmp_path / "doc.json", b'{"ok":true}\n')
        assert json.loads((tmp_path / "doc.json").read_text()) == {"ok": True}
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["doc.json", leftover.name])

    def test_rollout_files_create_a_missing_directory(self, tmp_path: Path) -> None:
        """``write_rollout_files`` makes the rollout directory when it does not exist yet."""
        rollout_dir = tmp_path / "deep" / "r1"
        write_rollout_files(rollout_dir, {"x": 1}, {"workflow_error": {"message": "m"}})
        assert json.loads((rollout_dir / "trajectory.json").read_text()) == {"x": 1}
        assert json.loads((rollout_dir / "diagnostics.json").read_text()) == {
            "workflow_error": {"message": "m"}
        }

    def test_rollout_files_without_a_trajectory(self, tmp_path: Path) -> None:
        """Without a trajectory only diagnostics are written; with neither, nothing is (not
        even the directory)."""
        write_rollout_files(tmp_path / "r1", None, {"workflow_error": {"message": "m"}})
        assert sorted(p.name for p in (tmp_path / "r1").iterdir()) == ["diagnostics.json"]
        write_rollout_files(tmp_path / "r2", None, None)
        assert not (tmp_path / "r2").exists()

    def test_encode_json_is_compact_strict_json(self, caplog: pytest.LogCaptureFixture) -> None:
        """A clean document encodes as compact UTF-8 JSON with a final newline, tuples as
        lists, and nothing logged."""
        with caplog.at_level(logging.WARNING):
            data = encode_document({"a": "é", "b": (1, 2.5), "c": None}, "doc")
        assert data == '{"a":"é","b":[1,2.5],"c":null}\n'.encode()
        assert caplog.records == []

    def test_encode_json_fits_what_json_cannot_hold(self, caplog: pytest.LogCaptureFixture) -> None:
        """NaN, objects and lone surrogates are dropped or replaced (fit_json), and one
        WARNING names the document, its owner and every dropped path."""
        document = {"ok": 1, "nan": float("nan"), "obj": object(), "text": "a\ud800b"}
        with caplog.at_level(logging.WARNING):
            data = encode_document(document, "trajectory", "rollout r1")
        assert json.loads(data) == {"ok": 1, "text": "a?b"}
        (record,) = caplog.records
        message = record.getMessage()
        assert message.startswith("Trajectory of rollout r1: dropped values")
        assert "trajectory.nan" in message
        assert "trajectory.obj" in message

    def test_failed_write_leaves_no_temporary(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When the final rename fails, the error propagates and the temporary is removed."""

        def refuse(_src: str, _dst: object) -> None:
            raise PermissionError("read-only")

        monkeypatch.setattr(os, "replace", refuse)
        with pytest.raises(PermissionError):
            write_json_atomic(tmp_path / "doc.json", b"{}\n")
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize("existing", ["none", "root-missing", "exists"])
    def test_make_directory(self, tmp_path: Path, existing: str) -> None:
        """The directory is made whatever part of its path already exists."""
        root = tmp_path / "root" if existing == "root-missing" else tmp_path
        path = root / "r1"
        if existing == "exists":
            path.mkdir()
        make_directory(path)
        assert path.is_dir()

    def test_make_directory_reports_a_file_in_the_way(self, tmp_path: Path) -> None:
        """A file where the directory should be is an OSError."""
        (tmp_path / "r1").write_text("not a directory")
        with pytest.raises(OSError):
            make_directory(tmp_path / "r1")


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("t", logging.INFO, __file__, 1, message, None, None)


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


class TestTurnBufferedStreamHandler:
    def test_without_a_loop_each_line_is_written_at_once(self) -> None:
        """Outside an event loop every record is written immediately."""
        stream = _CountingStream()
        handler = TurnBufferedStreamHandler(stream)
        handler.handle(_record("one"))
        assert stream.getvalue() == "one\n"
        handler.handle(_record("two"))
        assert stream.getvalue() == "one\ntwo\n"

    async def test_lines_of_one_turn_are_written_together_in_order(self) -> None:
        """Records of one loop turn reach the stream in one write at the end of the turn."""
        stream = _CountingStream()
        handler = TurnBufferedStreamHandler(stream)
        for n in range(3):
            handler.handle(_record(f"line {n}"))
        assert stream.getvalue() == ""
        await asyncio.sleep(0)
        assert stream.getvalue() == "line 0\nline 1\nline 2\n"
        assert stream.writes == 1

    async def test_flush_writes_what_is_buffered(self) -> None:
        """An explicit flush (as at exit) writes buffered lines at once."""
        stream = _CountingStream()
        handler = TurnBufferedStreamHandler(stream)
        handler.handle(_record("pending"))
        handler.flush()
        assert stream.getvalue() == "pending\n"

    async def test_a_line_from_another_thread_keeps_the_order(self) -> None:
        """A record from a thread without a loop is written at once, after the lines the
        loop has buffered so far."""
        stream = _CountingStream()
        handler = TurnBufferedStreamHandler(stream)
        handler.handle(_record("loop"))
        await asyncio.to_thread(handler.handle, _record("thread"))
        assert stream.getvalue() == "loop\nthread\n"
