"""Reading processes from Linux's /proc: command line, environment, parent, state, start time, threads,
how often they ran, page faults; and the host's pressure stall information.

Owns the file formats only; every reader returns an empty/None answer for a process that is gone
or unreadable, and knows nothing about Triton.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _nul_separated(pid: int, name: str) -> list[str]:
    try:
        raw = (PROC / str(pid) / name).read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def cmdline(pid: int) -> list[str]:
    return _nul_separated(pid, "cmdline")


def environment(pid: int) -> dict[str, str]:
    pairs = (entry.partition("=") for entry in _nul_separated(pid, "environ"))
    return {name: value for name, _, value in pairs}


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (state) on: what follows "(comm)", which may hold spaces and ")"."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Running (neither gone nor a zombie)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def alive_since(pid: int, ticks: int | None) -> bool:
    """Running, and the same process that started at `ticks` (`start_ticks`): one read of its stat."""
    fields = _stat_fields(pid)
    return len(fields) > 19 and fields[0] not in ("Z", "X") and fields[19] == str(ticks)


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot: with the pid, tells a process from a later
    one that reuses its pid (unlike `started_at`, it does not move when the wall clock is set)."""
    try:
        return int(_stat_fields(pid)[19])
    except (IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, clock-tick resolution)."""
    try:
        ticks = int(_stat_fields(pid)[19])
        lines = (PROC / "stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in lines if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def age(pid: int) -> float | None:
    """How long process `pid` has been running, in seconds (clock-tick resolution)."""
    try:
        ticks = int(_stat_fields(pid)[19])
        uptime = float((PROC / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [candidate for candidate in pids() if parent(candidate) == pid]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on (parents before children)."""
    by_parent: dict[int, list[int]] = {}
    for candidate in pids():
        parent_pid = parent(candidate)
        if parent_pid is not None:
            by_parent.setdefault(parent_pid, []).append(candidate)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = by_parent.get(frontier.pop(0), [])
        found.extend(below)
        frontier.extend(below)
    return found


def threads(pid: int) -> list[int]:
    """The thread ids of process `pid`, in order (empty if it is gone)."""
    try:
        return sorted(int(entry.name) for entry in (PROC / str(pid) / "task").iterdir() if entry.name.isdigit())
    except OSError:
        return []


def wchan(pid: int, tid: int) -> str:
    """Where thread `tid` sleeps in the kernel ("" if unknown)."""
    try:
        return (PROC / str(pid) / "task" / str(tid) / "wchan").read_text()
    except OSError:
        return ""


def thread_runs(pid: int, tid: int) -> int | None:
    """How many times thread `tid` has been run on a CPU (schedstat, third field)."""
    try:
        return int((PROC / str(pid) / "task" / str(tid) / "schedstat").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return None


def process_runs(pid: int) -> int | None:
    """How many times the threads of process `pid` have been run on a CPU, summed; None if it is gone."""
    tids = threads(pid)
    if not tids:
        return None
    return sum(runs for runs in (thread_runs(pid, tid) for tid in tids) if runs is not None)


def faults(pid: int) -> dict[str, int | str]:
    """Its state, minor and major page faults so far and thread count ({} if it is gone)."""
    fields = _stat_fields(pid)
    try:
        return {"state": fields[0], "minor": int(fields[7]), "major": int(fields[9]), "threads": int(fields[17])}
    except (IndexError, ValueError):
        return {}


def pressure() -> dict[str, str]:
    """The host's pressure stall information per resource (its lines joined by " | "), where the kernel has it."""
    found = {}
    for resource in ("cpu", "io", "memory"):
        try:
            found[resource] = (PROC / "pressure" / resource).read_text().strip().replace("\n", " | ")
        except OSError:
            continue
    return found
