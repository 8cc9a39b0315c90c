"""What the guard decides from what it reads of its stub: vouch, record a stall, or call the stub lost.

Owns the rules and their timings; must not read or write anything itself (stubguard/guard.py does),
so the rules are tested with made-up readings.

Why these rules (docs/lifecycle.md, "A stalled stub"): tritonserver's Python backend gives up on a
stub whose answer has not come within 1 s while its health flag stayed false, and what it then
frees the stub reads later, which aborts tritonserver. The guard sets the flag for a stub that is
alive but not running (stopped, frozen alone, starved), so Triton waits for the answer instead.
It cannot do that when it was not running itself (the stub and the guard frozen together); then
Triton may have given up, and the two ways that shows afterwards (the stub dies, or its answer
lies in Triton's queue with nobody waiting for it) make the stub lost: the server must not serve on.
"""

from __future__ import annotations

from dataclasses import dataclass

from triton_vllm_multistep.stubguard.ipc import QueueState

# Every 100 ms: a vouch lands at most ~0.5 s after Triton clears the flag (it looks at 1 s); ~0.4% of a core.
POLL_SECONDS = 0.1
# The stub's health thread sets the flag every 300 ms; Triton checks it 1 s after clearing it.
VOUCH_AFTER_SECONDS = 0.4
# A stall this long is one Triton would have given up on: worth a line in the log.
REPORTED_STALL_SECONDS = 1.0
# The guard itself did not run for this long: it may have missed Triton's 1-s check.
GUARD_GAP_SECONDS = 0.9
# The wall clock stepped forward this much: tritonserver 2.51 times its 1-s wait by the wall clock
# (boost::get_system_time), so a wait under way when it stepped ends at once, and with it the stub.
CLOCK_STEP_SECONDS = 0.5
# After such a gap or step, a stub death within this long counts as caused by it.
AFTER_GAP_SECONDS = 5.0
# An answer in Triton's queue this long with nothing asked of the stub: nobody waits for it. Seen over
# readings this close together only: on a starved host tritonserver's waiting thread may not have
# run yet to take it (a guard that did not run itself cannot tell), and a false "lost" kills a server.
STALE_ANSWER_SECONDS = 2.0
STALE_READINGS_APART_SECONDS = 0.3
# tritonserver's threads were run this many times while the answer waited: it was not starved.
SERVER_RAN_RUNS = 5


@dataclass(frozen=True)
class Reading:
    at: float  # monotonic seconds
    wall_offset: float  # wall-clock time minus `at`: moves only when the wall clock is set
    alive: bool  # the stub process runs (not gone, not a zombie)
    finalized: bool  # the stub said it is finalizing: its exit is expected
    health: bool  # the stub's health flag
    # How many times the stub's health thread has been run (None: that thread is not known): it runs
    # every 300 ms, so a count that stands still means the stub is not running.
    health_thread_runs: int | None
    stub_queue: QueueState  # tritonserver → stub
    parent_queue: QueueState  # stub → tritonserver
    # How many times tritonserver's threads have been run, summed (None: not read). Read only while an
    # answer seems stale: it tells a tritonserver that did not run (starved) from one that did not wait.
    server_runs: int | None = None


@dataclass(frozen=True)
class Vouch:
    pass


@dataclass(frozen=True)
class StallOver:
    seconds: float
    vouches: int


@dataclass(frozen=True)
class GuardGap:
    seconds: float
    waited_on: bool  # at its end Triton was waiting for the stub (the flag down, or a message unread)


@dataclass(frozen=True)
class ClockStep:
    seconds: float


@dataclass(frozen=True)
class StubGone:
    expected: bool


@dataclass(frozen=True)
class StubLost:
    reason: str


Action = Vouch | StallOver | GuardGap | ClockStep | StubGone | StubLost


class Watch:
    """The guard's state between readings; `observe` returns what to do about the latest one."""

    def __init__(self) -> None:
        self._last_at: float | None = None
        self._wall_offset: float | None = None
        self._runs: int | None = None
        self._quiet_since: float | None = None  # the health thread has not run (or the flag is down) since
        self._stall_started: float | None = None
        self._vouches = 0
        self._gap_at: float | None = None
        self._stale_since: float | None = None
        self._stale_queue: tuple[QueueState, QueueState] | None = None
        self._stale_server_runs: int | None = None
        self._stale_stub_runs: int | None = None
        self.done = False

    @property
    def wants_server_runs(self) -> bool:
        """Whether the next reading should carry `server_runs` (an answer seems stale)."""
        return self._stale_since is not None

    def observe(self, reading: Reading) -> list[Action]:
        if self.done:
            return []
        actions: list[Action] = []
        now = reading.at
        apart = None if self._last_at is None else now - self._last_at
        if apart is not None and apart >= GUARD_GAP_SECONDS:
            # Whatever the reading after it shows: the stub, resumed with the guard (or before it), may
            # have raised its flag and taken its messages already.
            self._gap_at = now
            actions.append(GuardGap(apart, waited_on=not reading.health or reading.stub_queue.depth > 0))
        if apart is None or apart >= STALE_READINGS_APART_SECONDS:
            self._stale_since = self._stale_queue = self._stale_server_runs = None
        self._last_at = now
        if self._wall_offset is not None and reading.wall_offset - self._wall_offset >= CLOCK_STEP_SECONDS:
            self._gap_at = now
            actions.append(ClockStep(reading.wall_offset - self._wall_offset))
        self._wall_offset = reading.wall_offset
        if not reading.alive:
            self.done = True
            actions.extend(self._stall_over(now))
            actions.append(StubGone(expected=reading.finalized))
            if not reading.finalized and self._gap_at is not None and now - self._gap_at <= AFTER_GAP_SECONDS:
                actions.append(
                    StubLost("it died right after it and its guard were stalled together, or the wall clock stepped")
                )
            return actions
        actions.extend(self._vouch_if_needed(reading))
        if not reading.finalized and self._stale_answer(reading):
            self.done = True
            actions.append(
                StubLost("its answer lies in tritonserver's queue with nothing asked: tritonserver gave up on it")
            )
        return actions

    def _vouch_if_needed(self, reading: Reading) -> list[Action]:
        now = reading.at
        if reading.health_thread_runs is not None:
            if reading.health_thread_runs != self._runs or self._quiet_since is None:
                ran = self._runs is not None and reading.health_thread_runs != self._runs
                self._runs, self._quiet_since = reading.health_thread_runs, now
                if ran:
                    return self._stall_over(now)
        elif reading.health or self._quiet_since is None:  # without the thread: the flag up is a sign of life
            self._quiet_since = now
            if reading.health:
                return self._stall_over(now)
        if reading.health or now - self._quiet_since < VOUCH_AFTER_SECONDS:
            return []
        if self._stall_started is None:
            self._stall_started = self._quiet_since
        self._vouches += 1
        if reading.health_thread_runs is None:
            self._quiet_since = now  # the flag is up now: quiet again from here
        return [Vouch()]

    def _stall_over(self, now: float) -> list[Action]:
        if self._stall_started is None:
            return []
        seconds, vouches = now - self._stall_started, self._vouches
        self._stall_started, self._vouches = None, 0
        return [StallOver(seconds, vouches)]

    def _stale_answer(self, reading: Reading) -> bool:
        """An answer waits in the parent queue, nothing waits in the stub's, for STALE_ANSWER_SECONDS
        with neither queue moving. Triton pops an answer the moment it comes (it is waiting for it)."""
        queues = (reading.stub_queue, reading.parent_queue)
        if reading.parent_queue.depth == 0 or reading.stub_queue.depth != 0:
            self._stale_since = self._stale_queue = self._stale_server_runs = None
            return False
        if queues != self._stale_queue:
            self._stale_since, self._stale_queue, self._stale_server_runs = reading.at, queues, None
            return False
        if self._stale_server_runs is None:
            self._stale_server_runs = reading.server_runs
            self._stale_stub_runs = reading.health_thread_runs
        assert self._stale_since is not None
        if reading.at - self._stale_since < STALE_ANSWER_SECONDS:
            return False
        # The stub ran meanwhile (a stub stopped inside its push has moved the queue's head but not yet
        # woken Triton), and so did tritonserver's threads (its waiting thread would have taken it).
        stub_before, stub_now = self._stale_stub_runs, reading.health_thread_runs
        if stub_before is not None and stub_now is not None and stub_now == stub_before:
            return False
        before, now = self._stale_server_runs, reading.server_runs
        return before is not None and now is not None and now - before >= SERVER_RAN_RUNS
