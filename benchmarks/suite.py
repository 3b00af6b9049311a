"""The benchmark suite: which runs make up each workload, in what order, with what counts.

Workloads (each repeated ``repetitions`` times; every run has a fresh server process):

- ``throughput``: closed-loop rollouts at each concurrency, each stack with its own client.
- ``notify``: a workflow that sleeps 200 ms at concurrency 64; the end-to-end latency
  minus the sleep shows how fast the long poll delivers completion.
- ``inflight``: thousands of held rollouts long-polling at once, then released together.
  With our stack it also runs our client against the HTTP floor (:data:`FLOOR`): a bare
  aiohttp app that answers the same admissions and long polls and does nothing else.
- ``cpu``: server and client CPU per rollout at concurrency 512 (the throughput runs at
  that concurrency serve it when both are selected).
- ``cross``: our client against the osmosis server and the osmosis client against ours.
- ``pool``: our stack only: ``RolloutClientPool`` over two servers (a ``rollout-server
  serve`` process each) against one server, at concurrency 64, next to the plain
  ``RolloutClient`` over one server.

Runs alternate the stacks (ours first in even repetitions, osmosis first in odd ones) so
that drifting background load hits both alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "FLOOR",
    "POOL_SHAPES",
    "STACKS",
    "WORKLOADS",
    "Profile",
    "RunSpec",
    "plan_runs",
    "profile_named",
]

STACKS: Final = ("ours", "osmosis")
FLOOR: Final = "floor"
"""The server of the HTTP-floor runs (``benchmarks.apps.floor_app``), driven by our client."""
WORKLOADS: Final = ("throughput", "notify", "inflight", "cpu", "cross", "pool")
POOL_SHAPES: Final = ((False, 1), (True, 1), (True, 2))
"""The ``pool`` workload's runs: (whether the client is a pool, how many servers)."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Counts and timings of one suite run (``full``, ``quick`` or ``tiny``).

    Attributes:
        name: The profile's name.
        repetitions: Runs of every configuration.
        throughput_count: Measured rollouts per throughput run.
        concurrencies: Client concurrencies of the throughput workload.
        warmup_min: Unmeasured rollouts before each closed-loop run, at least (each run
            warms up with ``max(warmup_min, concurrency)`` rollouts, which opens every
            connection it will use).
        notify_count: Measured rollouts per notification run.
        notify_concurrency: Client concurrency of the notification workload.
        notify_sleep_sec: Workflow sleep of the notification workload, seconds.
        inflight_counts: Held rollouts per in-flight run, by server: a stack, or
            :data:`FLOOR` (run when our stack is selected).
        hold_sec: Seconds from the first admission to the release, at least.
        idle_min_sec: Shortest idle window (CPU measured) after the last admission, seconds.
        settle_sec: Pause between the last admission and the idle window, seconds.
        cpu_concurrency: Client concurrency of the CPU workload.
        cpu_count: Measured rollouts per CPU run (when not served by a throughput run).
        cross_concurrency: Client concurrency of the cross pairs.
        cross_count: Measured rollouts per cross run.
        pool_concurrency: Client concurrency of the pool runs.
        pool_count: Measured rollouts per pool run.
    """

    name: str
    repetitions: int
    throughput_count: int
    concurrencies: tuple[int, ...]
    warmup_min: int
    notify_count: int
    notify_concurrency: int
    notify_sleep_sec: float
    inflight_counts: dict[str, tuple[int, ...]] = field(hash=False)
    hold_sec: float
    idle_min_sec: float
    settle_sec: float
    cpu_concurrency: int
    cpu_count: int
    cross_concurrency: int
    cross_count: int
    pool_concurrency: int
    pool_count: int

    def with_overrides(self, **changes: Any) -> Profile:
        """A copy with the given attributes replaced (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


FULL: Final = Profile(
    name="full",
    repetitions=3,
    throughput_count=2000,
    concurrencies=(1, 64, 512),
    warmup_min=16,
    notify_count=640,
    notify_concurrency=64,
    notify_sleep_sec=0.2,
    inflight_counts={"ours": (5000, 10000), "osmosis": (5000,), FLOOR: (5000,)},
    hold_sec=20.0,
    idle_min_sec=5.0,
    settle_sec=1.0,
    cpu_concurrency=512,
    cpu_count=2000,
    cross_concurrency=64,
    cross_count=2000,
    pool_concurrency=64,
    pool_count=2000,
)

QUICK: Final = Profile(
    name="quick",
    repetitions=1,
    throughput_count=200,
    concurrencies=(1, 64),
    warmup_min=8,
    notify_count=128,
    notify_concurrency=64,
    notify_sleep_sec=0.2,
    inflight_counts={"ours": (500,), "osmosis": (500,), FLOOR: (500,)},
    hold_sec=3.0,
    idle_min_sec=1.0,
    settle_sec=0.5,
    cpu_concurrency=512,
    cpu_count=512,
    cross_concurrency=64,
    cross_count=128,
    pool_concurrency=64,
    pool_count=200,
)

TINY: Final = Profile(
    name="tiny",
    repetitions=1,
    throughput_count=6,
    concurrencies=(1, 3),
    warmup_min=1,
    notify_count=4,
    notify_concurrency=2,
    notify_sleep_sec=0.05,
    inflight_counts={"ours": (6,), "osmosis": (6,), FLOOR: (6,)},
    hold_sec=0.3,
    idle_min_sec=0.1,
    settle_sec=0.1,
    cpu_concurrency=4,
    cpu_count=8,
    cross_concurrency=2,
    cross_count=4,
    pool_concurrency=3,
    pool_count=6,
)

_PROFILES: Final = {profile.name: profile for profile in (FULL, QUICK, TINY)}


def profile_named(name: str) -> Profile:
    """The profile called ``name``.

    Raises:
        ValueError: For an unknown name (the message lists the known ones).
    """
    try:
        return _PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(_PROFILES)}") from None


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run: a fresh server of ``server``, one load generator with ``client``'s client.

    Attributes:
        workloads: The workloads whose tables this run feeds.
        client: The client's stack.
        server: The server's stack.
        shape: ``closed`` or ``inflight`` (see :mod:`benchmarks.loadgen`).
        repetition: 0-based repetition number.
        count: Measured rollouts.
        concurrency: Closed-loop workers (1 for in-flight runs).
        warmup: Unmeasured rollouts first (closed loop).
        sleep_sec: Workflow sleep (closed loop), seconds.
        stagger_sec: Closed loop: worker ``i`` of ``C`` starts each phase
            ``stagger_sec * i / C`` seconds late, so that equal-length rollouts do not
            start and finish in lockstep; 0 starts every worker at once.
        hold_sec, idle_min_sec, settle_sec: In-flight timings, seconds.
        deadline_sec: Bound on the whole load-generator run, seconds.
        servers: Server processes of ``server`` the run starts (closed loop only).
        pool: Whether the load generator drives them with ``RolloutClientPool`` (ours
            only) instead of ``RolloutClient``.
    """

    workloads: tuple[str, ...]
    client: str
    server: str
    shape: str
    repetition: int
    count: int
    concurrency: int = 1
    warmup: int = 0
    sleep_sec: float = 0.0
    stagger_sec: float = 0.0
    hold_sec: float = 0.0
    idle_min_sec: float = 0.0
    settle_sec: float = 0.0
    deadline_sec: float = 600.0
    servers: int = 1
    pool: bool = False

    @property
    def label(self) -> str:
        """A short name for logs: ``throughput-ours-ours-c64-r0``."""
        size = f"c{self.concurrency}" if self.shape == "closed" else f"n{self.count}"
        if self.stagger_sec:
            size += "-staggered"
        if self.pool:
            size += f"-pool{self.servers}"
        return f"{self.workloads[0]}-{self.client}-{self.server}-{size}-r{self.repetition}"

    def loadgen_args(self, *, urls: list[str], server_pids: list[int], loop: str) -> list[str]:
        """The load generator's command-line arguments for this run (a server each URL)."""
        args = ["--client", self.client]
        for url, pid in zip(urls, server_pids, strict=True):
            args += ["--url", url, "--server-pid", str(pid)]
        if self.pool:
            args.append("--pool")
        args += [
            "--shape",
            self.shape,
            "--count",
            str(self.count),
            "--deadline-sec",
            repr(self.deadline_sec),
            "--loop",
            loop,
        ]
        if self.shape == "closed":
            args += ["--concurrency", str(self.concurrency), "--warmup", str(self.warmup)]
            args += ["--sleep-sec", repr(self.sleep_sec), "--stagger-sec", repr(self.stagger_sec)]
        else:
            args += ["--hold-sec", repr(self.hold_sec), "--idle-min-sec", repr(self.idle_min_sec)]
            args += ["--settle-sec", repr(self.settle_sec)]
        return args


def _closed_deadline(count: int, concurrency: int, sleep_sec: float, warmup: int) -> float:
    # Generous: 25 rollouts/s overall plus the sleeps, and never under a minute.
    rounds = math.ceil((count + warmup) / max(concurrency, 1))
    return max(60.0, (count + warmup) / 25.0 + rounds * sleep_sec * 2)


def _pairs(stacks: tuple[str, ...], repetition: int) -> Iterator[str]:
    ordered = stacks if repetition % 2 == 0 else tuple(reversed(stacks))
    yield from ordered


def plan_runs(
    profile: Profile, workloads: tuple[str, ...], stacks: tuple[str, ...]
) -> list[RunSpec]:
    """Every run of the suite, in execution order.

    Args:
        profile: Counts and timings.
        workloads: The selected workloads (a subset of :data:`WORKLOADS`).
        stacks: The selected stacks (a subset of :data:`STACKS`); ``cross`` needs both.

    Returns:
        The runs, repetition by repetition, stacks alternating; in-flight runs against
        :data:`FLOOR` follow our stack's; the pool runs (ours only, :data:`POOL_SHAPES`)
        end each repetition.

    Raises:
        ValueError: For an unknown workload or stack.
    """
    for name in workloads:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {list(WORKLOADS)}")
    for stack in stacks:
        if stack not in STACKS:
            raise ValueError(f"unknown stack {stack!r}; choose from {list(STACKS)}")
    p = profile
    runs: list[RunSpec] = []
    for rep in range(p.repetitions):
        if "throughput" in workloads:
            for concurrency in p.concurrencies:
                fed = ("throughput", "cpu") if concurrency == p.cpu_concurrency else ("throughput",)
                warmup = max(p.warmup_min, concurrency)
                for stack in _pairs(stacks, rep):
                    runs.append(
                        RunSpec(
                            workloads=fed if "cpu" in workloads else ("throughput",),
                            client=stack,
                            server=stack,
                            shape="closed",
                            repetition=rep,
                            count=p.throughput_count,
                            concurrency=concurrency,
                            warmup=warmup,
                            deadline_sec=_closed_deadline(
                                p.throughput_count, concurrency, 0.0, warmup
                            ),
                        )
                    )
        if "cpu" in workloads and not (
            "throughput" in workloads and p.cpu_concurrency in p.concurrencies
        ):
            warmup = max(p.warmup_min, p.cpu_concurrency)
            for stack in _pairs(stacks, rep):
                runs.append(
                    RunSpec(
                        workloads=("cpu",),
                        client=stack,
                        server=stack,
                        shape="closed",
                        repetition=rep,
                        count=p.cpu_count,
                        concurrency=p.cpu_concurrency,
                        warmup=warmup,
                        deadline_sec=_closed_deadline(p.cpu_count, p.cpu_concurrency, 0.0, warmup),
                    )
                )
        if "notify" in workloads:
            warmup = max(p.warmup_min, p.notify_concurrency)
            # Staggered starts measure delivery; lockstep also shows a burst of completions.
            for stagger_sec in (p.notify_sleep_sec, 0.0):
                for stack in _pairs(stacks, rep):
                    runs.append(
                        RunSpec(
                            workloads=("notify",),
                            client=stack,
                            server=stack,
                            shape="closed",
                            repetition=rep,
                            count=p.notify_count,
                            concurrency=p.notify_concurrency,
                            warmup=warmup,
                            sleep_sec=p.notify_sleep_sec,
                            stagger_sec=stagger_sec,
                            deadline_sec=_closed_deadline(
                                p.notify_count, p.notify_concurrency, p.notify_sleep_sec, warmup
                            ),
                        )
                    )
        if "inflight" in workloads:
            for stack in _pairs(stacks, rep):
                # Our client against the HTTP floor runs right after our own server.
                servers = (stack, FLOOR) if stack == "ours" else (stack,)
                counts = [(s, n) for s in servers for n in p.inflight_counts.get(s, ())]
                for server, count in counts:
                    runs.append(
                        RunSpec(
                            workloads=("inflight",),
                            client=stack,
                            server=server,
                            shape="inflight",
                            repetition=rep,
                            count=count,
                            hold_sec=p.hold_sec,
                            idle_min_sec=p.idle_min_sec,
                            settle_sec=p.settle_sec,
                            # The hold, then admission and release at >= 50/s each.
                            deadline_sec=max(180.0, p.hold_sec + count / 25.0),
                        )
                    )
        if "cross" in workloads and set(STACKS) <= set(stacks):
            warmup = max(p.warmup_min, p.cross_concurrency)
            for client, server in (("ours", "osmosis"), ("osmosis", "ours")):
                runs.append(
                    RunSpec(
                        workloads=("cross",),
                        client=client,
                        server=server,
                        shape="closed",
                        repetition=rep,
                        count=p.cross_count,
                        concurrency=p.cross_concurrency,
                        warmup=warmup,
                        deadline_sec=_closed_deadline(
                            p.cross_count, p.cross_concurrency, 0.0, warmup
                        ),
                    )
                )
        if "pool" in workloads and "ours" in stacks:
            warmup = max(p.warmup_min, p.pool_concurrency)
            for pool, servers in POOL_SHAPES:
                runs.append(
                    RunSpec(
                        workloads=("pool",),
                        client="ours",
                        server="ours",
                        shape="closed",
                        repetition=rep,
                        count=p.pool_count,
                        concurrency=p.pool_concurrency,
                        warmup=warmup,
                        servers=servers,
                        pool=pool,
                        deadline_sec=_closed_deadline(
                            p.pool_count, p.pool_concurrency, 0.0, warmup
                        ),
                    )
                )
    return runs
