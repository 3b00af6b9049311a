"""Read a process's CPU time and memory from ``/proc`` (Linux only, no psutil needed)."""

from __future__ import annotations

import os
import resource
from typing import Final

__all__ = ["cpu_seconds", "cpu_times", "memory_kib", "self_cpu_seconds", "tree_cpu_seconds"]

_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")

_UTIME_FIELD: Final = 11
"""Index of ``utime`` among the ``/proc/<pid>/stat`` fields that follow ``(comm)``."""


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU time of process ``pid`` (all its threads) so far.

    Args:
        pid: A live process id.

    Returns:
        ``(user, system)`` seconds, with the kernel's clock-tick resolution (usually 10 ms).

    Raises:
        OSError: When the process does not exist (``FileNotFoundError``) or ``/proc`` is
            unavailable.
    """
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        text = stat.read()
    # The command name may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime = int(fields[_UTIME_FIELD]), int(fields[_UTIME_FIELD + 1])
    return utime / _CLOCK_TICKS, stime / _CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, in seconds (see :func:`cpu_times`)."""
    return sum(cpu_times(pid))


def memory_kib(pid: int) -> tuple[int, int]:
    """Resident set size of process ``pid`` now and at its peak.

    Args:
        pid: A live process id.

    Returns:
        ``(VmRSS, VmHWM)`` in KiB.

    Raises:
        OSError: When the process does not exist or ``/proc`` is unavailable.
        ValueError: When ``/proc/<pid>/status`` lacks either line (a kernel thread).
    """
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    if len(values) != 2:
        raise ValueError(f"/proc/{pid}/status has no VmRSS/VmHWM lines")
    return values["VmRSS"], values["VmHWM"]


def self_cpu_seconds() -> float:
    """User plus system CPU time of the calling process so far, in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _stat(pid: int) -> tuple[str, int, float]:
    """``(comm, ppid, cpu seconds)`` of process ``pid``."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        text = stat.read()
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    cpu = (int(fields[_UTIME_FIELD]) + int(fields[_UTIME_FIELD + 1])) / _CLOCK_TICKS
    return comm, int(fields[1]), cpu


def tree_cpu_seconds(root: int) -> dict[int, tuple[str, str, float]]:
    """CPU time of process ``root`` and of every live descendant of it.

    Args:
        root: A live process id.

    Returns:
        ``{pid: (comm, cmdline, user plus system seconds)}``; a process that exits while
        it is read is left out.
    """
    stats: dict[int, tuple[str, int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = _stat(int(entry))
            except OSError:
                continue
    children: dict[int, list[int]] = {}
    for pid, (_comm, ppid, _cpu) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, tuple[str, str, float]] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        if pid not in stats:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        comm, _ppid, cpu = stats[pid]
        found[pid] = (comm, command, cpu)
        pending.extend(children.get(pid, []))
    return found
