"""The status-change grace under load: a grace that ends while the event loop has been
saturated all along is put off by another grace, up to the poll's own wait.

The loop thread's CPU clock is replaced by :class:`FakeLoopCpu`, so whether the loop counts
as saturated never depends on the machine running the tests.
"""

from __future__ import annotations

import asyncio

from rollout_server.state._deadlines import FIRE_SLACK_SEC
from rollout_server.state._registry import RolloutRegistry
from rollout_types import RolloutStatus

EVENT_SEC = 10.0
GRACE_SEC = 0.02


class FakeLoopCpu:
    """A loop-thread CPU clock that runs at twice the loop's clock while busy (a saturated
    loop) and stands still once :meth:`idle` is called.

    Twice, not once: the server reads the loop's clock and this one in two calls, and a
    test process preempted between them (a loaded machine) would otherwise see less CPU
    than wall time pass, below ``SATURATED_LOOP_SHARE``; a real CPU clock does not
    run while its thread is preempted.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._busy_since: float | None = loop.time()
        self._spent = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self._busy_since is None:
            return self._spent
        return self._spent + 2.0 * (self._loop.time() - self._busy_since)

    def idle(self) -> None:
        self._spent = self()
        self._busy_since = None


class _Rollout:
    """A registry with a short grace, one rollout held by ``gate``, and the fake clock."""

    def __init__(self, *, busy: bool = True, grace_sec: float = GRACE_SEC) -> None:
        loop = asyncio.get_running_loop()
        self.cpu = FakeLoopCpu(loop)
        if not busy:
            self.cpu.idle()
        self.registry = RolloutRegistry(
            polling_lease_timeout_sec=60.0,
            result_retention_sec=60.0,
            status_change_grace_sec=grace_sec,
            loop_cpu_clock=self.cpu,
        )
        self.gate: asyncio.Future[None] = loop.create_future()

        async def body() -> None:
            await self.gate

        self.record, _token = self.registry.register("r1", lambda _record: loop.create_task(body()))

    def wait(self, timeout_sec: float) -> asyncio.Future[None]:
        wait = self.registry.waits.begin(self.record, timeout_sec)
        assert wait is not None
        return wait

    def finish(self, *waits: asyncio.Future[None]) -> None:
        for wait in waits:
            self.registry.waits.end(self.record, wait)
        assert self.record.waiting == 0
        self.gate.set_result(None)
        self.registry.close()


async def _graces(count: int) -> None:
    """Let ``count`` graces pass (at least; a slow loop only lets more pass)."""
    await asyncio.sleep(count * GRACE_SEC)


class TestSaturatedLoop:
    async def test_the_progress_answer_is_put_off_and_the_result_answered_instead(
        self,
    ) -> None:
        """With the loop saturated, a change leaves the wait pending through ten graces
        (the record still lists exactly that one wait); the result then ends it at once."""
        rollout = _Rollout()
        wait = rollout.wait(3 * EVENT_SEC)
        rollout.registry.set_status(rollout.record, RolloutStatus.GRADING)
        await _graces(10)
        assert not wait.done()
        assert rollout.record.waiting == 1
        rollout.registry.publish(rollout.record, status=RolloutStatus.SUCCESS)
        assert wait.done()
        rollout.finish(wait)

    async def test_a_put_off_wait_still_ends_by_its_own_deadline(self) -> None:
        """Putting off never outlasts the poll's wait: a 0.2 s wait that stays saturated
        ends at 0.2 s, not earlier (no progress answer) and not later."""
        rollout = _Rollout()
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = rollout.wait(0.2)
        rollout.registry.set_status(rollout.record, RolloutStatus.GRADING)
        async with asyncio.timeout(EVENT_SEC):
            await wait
        assert loop.time() >= started + 0.2 - FIRE_SLACK_SEC
        assert rollout.record.body is None  # a timed-out wait: the poll answers the status
        rollout.finish(wait)

    async def test_the_progress_answer_follows_once_the_loop_has_room(self) -> None:
        """Saturated through several graces, then idle: the next grace that ends answers
        the change (the wait ends without a result)."""
        rollout = _Rollout()
        wait = rollout.wait(3 * EVENT_SEC)
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)
        await _graces(5)
        assert not wait.done()
        rollout.cpu.idle()
        async with asyncio.timeout(EVENT_SEC):
            await wait
        assert rollout.record.body is None
        assert rollout.record.status is RolloutStatus.RUNNING
        rollout.finish(wait)

    async def test_several_put_off_waits_are_all_answered_by_the_result(self) -> None:
        """Two polls of one rollout are put off together and both listed; the result ends
        both, and ending them leaves no wait deadline behind."""
        rollout = _Rollout()
        first = rollout.wait(3 * EVENT_SEC)
        second = rollout.wait(3 * EVENT_SEC)
        rollout.registry.set_status(rollout.record, RolloutStatus.GRADING)
        await _graces(10)
        assert not first.done()
        assert not second.done()
        assert rollout.record.waiting == 2
        rollout.registry.publish(rollout.record, status=RolloutStatus.SUCCESS)
        assert first.done()
        assert second.done()
        rollout.registry.waits.end(rollout.record, first)
        rollout.registry.waits.end(rollout.record, second)
        assert len(rollout.registry._deadlines) == 1  # only the retention deadline is left
        rollout.finish()

    async def test_a_poll_leaving_while_put_off_is_unlisted(self) -> None:
        """A poll that goes away (its client disconnected) while its grace is put off is
        removed with its deadline; the other poll of the rollout still waits."""
        rollout = _Rollout()
        first = rollout.wait(3 * EVENT_SEC)
        second = rollout.wait(3 * EVENT_SEC)
        rollout.registry.set_status(rollout.record, RolloutStatus.GRADING)
        await _graces(5)
        rollout.registry.waits.end(rollout.record, first)
        assert first.cancelled()
        assert rollout.record.waiting == 1
        assert not second.done()
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)  # no effect yet
        await _graces(5)
        assert not second.done()
        rollout.cpu.idle()
        async with asyncio.timeout(EVENT_SEC):
            await second
        rollout.finish(second)

    async def test_a_status_not_yet_answered_is_put_off_alike(self) -> None:
        """A poll that arrives to find running (set between polls) waits as if running
        had begun as it arrived: saturated through ten graces it stays pending, and the
        result then ends it at once."""
        rollout = _Rollout()
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)  # nobody waits
        wait = rollout.wait(3 * EVENT_SEC)
        await _graces(10)
        assert not wait.done()
        rollout.registry.publish(rollout.record, status=RolloutStatus.SUCCESS)
        assert wait.done()
        rollout.finish(wait)


class TestIdleLoop:
    async def test_the_change_is_answered_by_the_grace(self) -> None:
        """With the loop idle, the wait ends within the grace of the change, well before
        its own 30 s."""
        rollout = _Rollout(busy=False)
        loop = asyncio.get_running_loop()
        wait = rollout.wait(3 * EVENT_SEC)
        changed = loop.time()
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)
        async with asyncio.timeout(EVENT_SEC):
            await wait
        assert loop.time() >= changed + GRACE_SEC - FIRE_SLACK_SEC
        assert rollout.record.body is None
        rollout.finish(wait)

    async def test_without_a_grace_a_saturated_loop_still_answers_at_once(self) -> None:
        """A grace of 0 (osmosis-ai's timing) answers every change at once, busy or not."""
        rollout = _Rollout(grace_sec=0.0)
        wait = rollout.wait(3 * EVENT_SEC)
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)
        assert wait.done()
        rollout.finish(wait)

    async def test_a_status_not_yet_answered_is_answered_by_the_grace(self) -> None:
        """With the loop idle, a poll that finds running (set between polls) ends a grace
        after its arrival without a result, well before its own 30 s."""
        rollout = _Rollout(busy=False)
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)  # nobody waits
        wait = rollout.wait(3 * EVENT_SEC)
        async with asyncio.timeout(EVENT_SEC):
            await wait
        assert rollout.record.body is None
        rollout.finish(wait)


class TestCpuClockReadings:
    async def test_graces_started_together_share_one_reading_of_the_clock(self) -> None:
        """Fifty polls that start their graces in the same loop turn read the loop thread's
        CPU clock once between them (it is a system call), not once each."""
        rollout = _Rollout()
        rollout.registry.set_status(rollout.record, RolloutStatus.RUNNING)
        before = rollout.cpu.reads
        waits = [rollout.wait(3 * EVENT_SEC) for _ in range(50)]
        assert rollout.cpu.reads - before <= 1
        rollout.registry.publish(rollout.record, status=RolloutStatus.SUCCESS)
        assert all(wait.done() for wait in waits)
        rollout.finish(*waits)
