"""Experiment beside a served benchmark run (issue #32's placement question): keep vLLM's V1 engine
core alone on the CPU vLLM's "auto" binding gave it, moving the stub and the engine process of the
server whose repository path holds MARK onto the other CPUs.

`python benchmarks/v1_core_alone_repin.py /v1_step_process/ &` before
`.venv/bin/python -m benchmarks.served_bench ... --configs v1_step_process ...`; polls every 0.5 s and
prints what it moved. A measurement tool, not product code (docs/performance.md, "The V1 engine's
placement"). Asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
V1_ENGINE_MODULE = "engine_v1.process"


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def threads(pid: int) -> list[int]:
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def children(pid: int) -> list[int]:
    found: list[int] = []
    for tid in threads(pid):
        try:
            found += [int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return found


def cpus_of(pid: int) -> set[int]:
    """The CPUs any thread of `pid` may run on."""
    cpus: set[int] = set()
    for tid in threads(pid):
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:
            continue
    return cpus


def pin(pid: int, cpus: set[int]) -> int:
    """Every thread of `pid` onto `cpus`; how many moved."""
    moved = 0
    for tid in threads(pid):
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
                moved += 1
        except OSError:
            continue
    return moved


def repin_once(mark: str, host_cpus: set[int]) -> None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stub = int(entry.name)
        line = command_line(stub)
        if STUB_BINARY not in line or mark not in line:
            continue
        for engine in (pid for pid in children(stub) if V1_ENGINE_MODULE in command_line(pid)):
            for core in children(engine):
                core_cpus = cpus_of(core)
                if not core_cpus or core_cpus == host_cpus:
                    continue
                others = host_cpus - core_cpus
                moved = pin(stub, others) + pin(engine, others)
                if moved:
                    print(
                        f"{time.strftime('%H:%M:%S')} stub {stub}, engine process {engine} -> CPUs {sorted(others)}, "
                        f"core {core} on {sorted(core_cpus)}: {moved} threads moved",
                        flush=True,
                    )


def main() -> None:
    mark = sys.argv[1]
    host_cpus = set(os.sched_getaffinity(0))
    while True:
        repin_once(mark, host_cpus)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
