"""The guard process of one Python stub: reads it every 100 ms and carries out what watch.py decides.

Owns the loop, the stub's liveness, the log lines and stall records, and taking tritonserver down
when its stub is lost; must not import anything heavy (it starts in ~50 ms beside every stub) nor
hold any lock tritonserver takes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from triton_vllm_multistep.lifecycle import procfs
from triton_vllm_multistep.stubguard import ipc, records, watch

ENTRY_MODULE = "triton_vllm_multistep.stubguard"  # python -m ENTRY_MODULE STUB_PID
FINALIZING = b"finalizing\n"  # what the stub writes on the guard's stdin before it exits
# Until then the guard looks for the stub's health thread at each reading (vouching by the flag alone).
HEALTH_THREAD_SEARCH_SECONDS = 5.0


@dataclass(frozen=True)
class Stub:
    pid: int
    start_ticks: int | None  # tells the stub from a later process with its pid
    server_pid: int
    arguments: ipc.StubArguments

    def alive(self) -> bool:
        return procfs.alive_since(self.pid, self.start_ticks)


def health_thread(pid: int) -> int | None:
    """The stub's health thread: the first of its threads asleep in nanosleep (pb_stub.cc starts it right
    after the interpreter, before any model code, and it sleeps 300 ms at a time); None if none is."""
    return next((tid for tid in procfs.threads(pid) if tid != pid and "nanosleep" in procfs.wchan(pid, tid)), None)


def keep_running(tid: int) -> None:
    """Real-time round-robin (lowest priority) for the stub's health thread, where allowed: the thread
    sleeps 300 ms, takes a mutex and sets a byte (no GIL), so at that priority a host busy with other
    work no longer keeps it from ticking, and Triton's one-second rule sees the stub alive whether or
    not the guard is run in time to vouch. Its CPU time is negligible. Where not allowed, left as is."""
    try:
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(1))
    except (OSError, AttributeError):
        pass


def run_promptly(log: TextIO) -> None:
    """Real-time round-robin (lowest priority) where allowed, else the highest nice allowed: a host so
    busy that the stub does not run for a second must not starve its guard as well (seen on 2 cores:
    processes of a busy session not run for 2.5 s). The guard uses ~0.4% of a core."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        return
    except (OSError, AttributeError):
        pass
    for nice in (-10, -5):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            return
        except OSError:
            continue
    print(
        "[triton-vllm-multistep stub guard] runs at normal priority (no CAP_SYS_NICE): on a host busy enough "
        "to starve the stub for a second it may be starved too",
        file=log,
        flush=True,
    )


class Guard:
    def __init__(self, stub: Stub, control: ipc.StubControl, finalize_signal: int | None, log: TextIO) -> None:
        self.stub = stub
        self.control = control
        self._finalize_signal = finalize_signal
        self._finalized = False
        self._log = log
        self._watch = watch.Watch()
        self._last_offset: float | None = None
        record_file = os.environ.get(records.RECORDS_ENV)
        self._records = Path(record_file) if record_file else None

    def run(self) -> None:
        run_promptly(self._log)
        tid, searching, started = None, True, time.monotonic()
        while not self._watch.done:
            if searching:
                # Looked for at each reading: it may be busy at a look (e.g. sending its first message).
                tid = health_thread(self.stub.pid)
                if tid is not None:
                    keep_running(tid)
                    searching = False
                elif time.monotonic() - started >= HEALTH_THREAD_SEARCH_SECONDS:
                    searching = False
                    print(
                        f"[triton-vllm-multistep stub guard] stub {self.stub.arguments.instance}: its health thread "
                        "was not found; vouching whenever its flag stays down",
                        file=self._log,
                        flush=True,
                    )
            self._wait(watch.POLL_SECONDS)
            at, wall_offset = self._clocks()
            alive = self.stub.alive()
            if not alive:
                self._wait(0)  # a stub that said FINALIZING and exited since the last look
            reading = watch.Reading(
                at=at,
                wall_offset=wall_offset,
                alive=alive,
                finalized=self._finalized,
                health=self.control.stub_health,
                health_thread_runs=None if tid is None else procfs.thread_runs(self.stub.pid, tid),
                server_runs=procfs.process_runs(self.stub.server_pid) if self._watch.wants_server_runs else None,
                stub_queue=self.control.stub_queue(),
                parent_queue=self.control.parent_queue(),
            )
            # A vouch first: Triton's 1-s check may be near; the log lines can wait.
            for action in sorted(self._watch.observe(reading), key=lambda a: not isinstance(a, watch.Vouch)):
                self._carry_out(action)

    def _clocks(self) -> tuple[float, float]:
        """(monotonic time, wall clock minus it); a pair read across a preemption keeps the last offset,
        so that it is not taken for a clock step."""
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        if after - before > 0.05 and self._last_offset is not None:
            return after, self._last_offset
        self._last_offset = wall - before
        return after, self._last_offset

    def _wait(self, seconds: float) -> None:
        """Sleep, waking early when the stub writes FINALIZING (or its end of the pipe closes)."""
        if self._finalize_signal is None or self._finalized:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self._finalize_signal], [], [], seconds)
        if ready:
            said = os.read(self._finalize_signal, 64)
            if said.startswith(FINALIZING):
                self._finalized = True
            elif not said:  # the stub's end closed without a word: it exited or died
                self._finalize_signal = None

    def _carry_out(self, action: watch.Action) -> None:
        instance = self.stub.arguments.instance
        if isinstance(action, watch.Vouch):
            self.control.vouch()
        elif isinstance(action, watch.StallOver):
            if action.seconds >= watch.REPORTED_STALL_SECONDS:
                self._say(
                    f"stub {instance} (pid {self.stub.pid}) did not run for {action.seconds:.1f} s; tritonserver "
                    f"kept waiting for it (its health flag set {action.vouches} times for it), nothing lost",
                    kind="contained",
                    seconds=round(action.seconds, 3),
                )
        elif isinstance(action, watch.GuardGap):
            self._say(
                f"the guard of stub {instance} did not run for {action.seconds:.1f} s: if tritonserver waited for "
                f"the stub meanwhile, it may have given up on it",
                quietly=not action.waited_on,
                kind="guard_gap",
                seconds=round(action.seconds, 3),
            )
        elif isinstance(action, watch.ClockStep):
            self._say(
                f"the wall clock stepped forward {action.seconds:.1f} s: tritonserver 2.51 times its wait for "
                f"stub {instance}'s answers by it, so a wait under way gave up at once",
                kind="clock_step",
                seconds=round(action.seconds, 3),
            )
        elif isinstance(action, watch.StubGone):
            if not action.expected:
                self._say(f"stub {instance} (pid {self.stub.pid}) exited without finalizing", kind="died")
        elif isinstance(action, watch.StubLost):
            self._say(
                f"stub {instance} (pid {self.stub.pid}) is lost: {action.reason}. Its shared memory with "
                f"tritonserver is no longer consistent (docs/lifecycle.md); stopping tritonserver (pid "
                f"{self.stub.server_pid}) before it serves a wrong answer or aborts",
                kind=records.LOST,
            )
            stop_server(self.stub.server_pid)

    def _say(self, message: str, *, kind: str, quietly: bool = False, **fields: object) -> None:
        """Log (unless `quietly`: recorded only) and record."""
        details = {"pressure": procfs.pressure(), "stub": procfs.faults(self.stub.pid)}
        if not quietly:
            print(f"[triton-vllm-multistep stub guard] {message} {json.dumps(details)}", file=self._log, flush=True)
        if self._records is None:
            return
        record = {
            "time": time.time(),
            "kind": kind,
            "instance": self.stub.arguments.instance,
            "pid": self.stub.pid,
            "message": message,
            **fields,
            **details,
        }
        try:
            records.append(self._records, record)
        except OSError as error:
            print(f"[triton-vllm-multistep stub guard] cannot record to {self._records}: {error}", file=self._log)


def stop_server(server_pid: int) -> None:
    """At once: SIGKILL, but SIGABRT for a PID 1 (a container's init ignores SIGKILL from inside)."""
    try:
        os.kill(server_pid, signal.SIGABRT if server_pid == 1 else signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    """`python -m triton_vllm_multistep.stubguard STUB_PID`; the stub's pipe on stdin."""
    stub_pid = int(argv[0])
    try:
        arguments = ipc.stub_arguments(procfs.cmdline(stub_pid))
        control = ipc.StubControl.open(arguments)
    except (ipc.LayoutError, OSError, ValueError, struct.error) as error:
        print(
            f"[triton-vllm-multistep stub guard] not guarding stub {stub_pid}: {error}. A stall of it over 1 s "
            "can abort tritonserver (docs/lifecycle.md)",
            file=sys.stderr,
            flush=True,
        )
        return 0
    server_pid = procfs.parent(stub_pid)  # tritonserver (PID 1 when it is a container's init)
    if not server_pid:
        print(
            f"[triton-vllm-multistep stub guard] not guarding stub {stub_pid}: its parent is gone",
            file=sys.stderr,
            flush=True,
        )
        return 0
    stub = Stub(stub_pid, procfs.start_ticks(stub_pid), server_pid, arguments)
    Guard(stub, control, sys.stdin.fileno(), sys.stderr).run()
    return 0
