"""A diagnostic thread in a stub that records every gap of over 250 ms in its own 50-ms wake-ups, with
what the kernel says about the process and the host at that moment (docs/lifecycle.md, "What stalls
a stub"). On only when TRITON_VLLM_MULTISTEP_STALL_DETECTOR names a file (JSON lines).

Owns that thread and its records; must not act on a stall (the stub guard does, stubguard/). A gap
here means this thread did not run: the whole process did not (the guard sees that too), or the GIL
was held that long by another thread (the guard does not: Triton's health thread needs no GIL).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from triton_vllm_multistep.lifecycle import procfs

DETECTOR_ENV = "TRITON_VLLM_MULTISTEP_STALL_DETECTOR"
WAKE_SECONDS = 0.05
GAP_SECONDS = 0.25
# /proc/self/sched fields worth keeping (scheduler's view of this thread group's main thread).
SCHED_FIELDS = (
    "se.sum_exec_runtime",
    "se.nr_migrations",
    "nr_switches",
    "nr_voluntary_switches",
    "nr_involuntary_switches",
    "se.statistics.wait_max",
    "se.statistics.wait_sum",
)


def _sched() -> dict[str, float]:
    found = {}
    try:
        for line in Path("/proc/self/sched").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in SCHED_FIELDS:
                found[name.strip()] = float(value)
    except (OSError, ValueError):
        pass
    return found


def _run(path: Path, instance: str) -> None:
    started = last = time.monotonic()
    cpu = time.process_time()
    while True:
        time.sleep(WAKE_SECONDS)
        now, cpu_now = time.monotonic(), time.process_time()
        gap, busy = now - last, cpu_now - cpu
        last, cpu = now, cpu_now
        if gap <= GAP_SECONDS:
            continue
        record = {
            "time": time.time(),
            "instance": instance,
            "pid": os.getpid(),
            "since_start": round(now - started, 3),
            "gap_seconds": round(gap, 3),
            # CPU the whole process used meanwhile: about the gap or more, another thread held the GIL;
            # about none, the process did not run (stopped, starved, waiting on I/O or memory).
            "process_cpu_seconds": round(busy, 3),
            "wall_minus_monotonic": round(time.time() - now, 3),  # a wall-clock step shows here
            "sched": _sched(),
            "pressure": procfs.pressure(),
            "faults": procfs.faults(os.getpid()),
        }
        try:
            with path.open("a") as out:
                out.write(json.dumps(record) + "\n")
        except OSError:
            return


def start_from_environment(instance: str) -> threading.Thread | None:
    """Start the detector when DETECTOR_ENV names a file; None otherwise."""
    path = os.environ.get(DETECTOR_ENV)
    if not path:
        return None
    thread = threading.Thread(target=_run, args=(Path(path), instance), name="stall-detector", daemon=True)
    thread.start()
    return thread
