"""CPU time of a RayBackend server's process tree by kind of process, for
:mod:`benchmarks.ray_bench`: the server (the Ray driver), ``gcs_server``, ``raylet``, the
``RolloutWorker`` actors, any other Ray process, and the calling process (the client)."""

from __future__ import annotations

from benchmarks.procstat import self_cpu_seconds, tree_cpu_seconds

__all__ = ["CpuMeter", "process_kind"]


def process_kind(comm: str, cmdline: str) -> str:
    """Which kind of process of a server's tree ``comm``/``cmdline`` is (the root is the
    ``server``)."""
    if comm == "gcs_server":
        return "gcs"
    if comm == "raylet":
        return "raylet"
    if cmdline.startswith("ray::RolloutWorker"):
        return "workers"
    return "ray_other"


class CpuMeter:
    """CPU seconds of a server's process tree by kind, and of this process (``client``)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self._start: dict[int, tuple[str, float]] = {}
        self._client = 0.0

    def _read(self) -> dict[int, tuple[str, float]]:
        read = tree_cpu_seconds(self.server_pid)
        return {
            pid: ("server" if pid == self.server_pid else process_kind(comm, cmdline), cpu)
            for pid, (comm, cmdline, cpu) in read.items()
        }

    def start(self) -> None:
        """Take the starting point."""
        self._start = self._read()
        self._client = self_cpu_seconds()

    def per_rollout_ms(self, rollouts: int) -> dict[str, float]:
        """CPU milliseconds per rollout since :meth:`start`, by kind, and their ``total``."""
        end = self._read()
        used: dict[str, float] = {}
        for pid, (kind, cpu) in end.items():
            before = self._start.get(pid, (kind, 0.0))[1]
            used[kind] = used.get(kind, 0.0) + cpu - before
        used["client"] = self_cpu_seconds() - self._client
        result = {kind: seconds / rollouts * 1e3 for kind, seconds in sorted(used.items())}
        result["total"] = sum(result.values())
        return result
