"""The stub guard's pieces without a server: reading python_backend r24.10's layout from a region
written here, and the rules that decide when to vouch for a stub and when it is lost.
(Through the real server: tests/e2e/test_health_lifecycle.py, the stall tests.)"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from triton_vllm_multistep.stubguard import ipc, records, watch
from triton_vllm_multistep.stubguard.ipc import QueueState

CONTROL_HANDLE = 336  # where tritonserver 2.51 put it in every stub seen (the value is the stub's argv[7])
STUB_QUEUE, PARENT_QUEUE = 496, 8688


def write_region(path: Path, *, decoupled: int, mutex_kind: int = ipc.ROBUST_SHARED_KIND) -> None:
    region = bytearray(1 << 16)
    control = CONTROL_HANDLE + ipc.OWNERSHIP_BYTES
    region[control : control + 4] = bytes([1, 0, 0, decoupled])
    struct.pack_into("i", region, control + ipc.STUB_HEALTH_MUTEX + ipc.PTHREAD_MUTEX_KIND, mutex_kind)
    struct.pack_into("5q", region, control + ipc.QUEUE_HANDLES, STUB_QUEUE, PARENT_QUEUE, 16880, 25072, 33264)
    for handle, (head, tail) in ((STUB_QUEUE, (6, 5)), (PARENT_QUEUE, (4, 4))):
        queue = handle + ipc.OWNERSHIP_BYTES
        struct.pack_into("q", region, queue + ipc.QUEUE_SIZE, 1000)
        struct.pack_into("2i", region, queue + ipc.QUEUE_HEAD, head, tail)
    path.write_bytes(bytes(region))


def stub_argv(region: str = "region") -> list[str]:
    return [
        "/b/triton_python_backend_stub",
        "/m/1/model.py",
        region,
        "1048576",
        "1048576",
        "42",
        "/b",
        "336",
        "m_0_0",
        "",
    ]


def test_the_stub_command_line_names_its_region_and_control_block() -> None:
    arguments = ipc.stub_arguments(stub_argv("triton_python_backend_shm_region_x"))
    assert arguments == ipc.StubArguments("triton_python_backend_shm_region_x", 336, "m_0_0")
    with pytest.raises(ipc.LayoutError, match="not a Triton Python stub"):
        ipc.stub_arguments(["/usr/bin/python3", "-m", "pytest"])


def test_the_control_block_is_read_and_the_health_flag_set(tmp_path: Path) -> None:
    write_region(tmp_path / "region", decoupled=1)
    control = ipc.StubControl.open(ipc.stub_arguments(stub_argv()), shm_dir=tmp_path)
    assert control.stub_health
    assert control.stub_queue() == QueueState(head=6, tail=5, size=1000) and control.stub_queue().depth == 1
    assert control.parent_queue().depth == 0
    control._region[CONTROL_HANDLE + ipc.OWNERSHIP_BYTES] = 0  # what tritonserver does before it waits
    assert not control.stub_health
    control.vouch()
    assert control.stub_health
    control.close()
    assert (tmp_path / "region").read_bytes()[CONTROL_HANDLE + ipc.OWNERSHIP_BYTES] == 1  # written through


@pytest.mark.parametrize(
    ("decoupled_byte", "kind", "message"),
    [
        (7, ipc.ROBUST_SHARED_KIND, r"flags read \[1, 0, 0, 7\], not bools"),
        (1, 0, "health mutex has kind 0x0"),
    ],
)
def test_another_layout_is_refused(tmp_path: Path, decoupled_byte: int, kind: int, message: str) -> None:
    write_region(tmp_path / "region", decoupled=decoupled_byte, mutex_kind=kind)
    with pytest.raises(ipc.LayoutError, match=message):
        ipc.StubControl.open(ipc.stub_arguments(stub_argv()), shm_dir=tmp_path)


IDLE = QueueState(0, 0, 1000)
WAITING = QueueState(1, 0, 1000)  # one message in the queue


def reading(
    at: float,
    *,
    runs: int | None = 7,
    health: bool = True,
    alive: bool = True,
    finalized: bool = False,
    stub_queue: QueueState = IDLE,
    parent_queue: QueueState = IDLE,
    wall: float = 1.8e9,
) -> watch.Reading:
    return watch.Reading(at, wall, alive, finalized, health, runs, stub_queue, parent_queue)


def observe_all(readings: list[watch.Reading]) -> list[watch.Action]:
    guard = watch.Watch()
    return [action for r in readings for action in guard.observe(r)]


def test_a_stub_that_does_not_run_is_vouched_for_while_triton_waits_and_its_stall_measured() -> None:
    at = [i * 0.05 for i in range(200)]
    # The health thread runs until 1.0 s, then not until 6.0 s (a 5-s SIGSTOP); Triton clears the flag
    # at 1.2 s and every second after it while it waits; a vouch raises it.
    actions: list[watch.Action] = []
    guard = watch.Watch()
    flag = True
    for t in at:
        runs = int(t / 0.3) if t < 1.0 or t >= 6.0 else 3
        if any(abs(t - c) < 1e-9 for c in (1.2, 2.2, 3.2, 4.2, 5.2)):
            flag = False
        done = guard.observe(reading(t, runs=runs, health=flag, stub_queue=WAITING))
        if any(isinstance(a, watch.Vouch) for a in done):
            flag = True
        actions += done
    vouches = [a for a in actions if isinstance(a, watch.Vouch)]
    assert len(vouches) == 5  # one for each time Triton cleared the flag
    (over,) = [a for a in actions if isinstance(a, watch.StallOver)]
    assert over.vouches == 5 and 4.9 <= over.seconds <= 5.1


def test_a_busy_stub_whose_flag_is_mostly_down_is_not_vouched_for() -> None:
    # Under load Triton clears the flag at every request; the health thread runs every 300 ms.
    readings = [reading(i * 0.05, runs=int(i * 0.05 / 0.3), health=i % 6 == 0) for i in range(100)]
    assert observe_all(readings) == []


def test_without_the_health_thread_a_flag_down_for_400_ms_is_vouched_for() -> None:
    readings = [reading(i * 0.05, runs=None, health=False) for i in range(9)]
    assert [type(a) for a in observe_all(readings)] == [watch.Vouch]


def test_a_stub_that_dies_after_it_and_its_guard_were_stalled_together_is_lost() -> None:
    # The flag up again at the first reading after the gap: the stub resumed first and raised it.
    actions = observe_all([reading(0.0), reading(2.5), reading(2.55, alive=False)])
    assert [type(a) for a in actions] == [watch.GuardGap, watch.StubGone, watch.StubLost]
    assert isinstance(actions[0], watch.GuardGap) and actions[0].seconds == pytest.approx(2.5)


def test_a_stub_that_dies_otherwise_is_reported_not_lost() -> None:
    assert observe_all([reading(0.0), reading(0.05, alive=False)]) == [watch.StubGone(expected=False)]
    assert observe_all([reading(0.0), reading(0.05, alive=False, finalized=True)]) == [watch.StubGone(expected=True)]
    # The same death long after a guard gap is not blamed on it.
    after_gap = [reading(0.0), *(reading(2.0 + i * 0.05) for i in range(110)), reading(7.55, alive=False)]
    assert [type(a) for a in observe_all(after_gap)] == [watch.GuardGap, watch.StubGone]


def test_an_answer_nobody_waits_for_makes_the_stub_lost() -> None:
    def stale(i: int, *, stub_runs: bool = True, server_runs: int = 10, gap_at: int | None = None) -> watch.Reading:
        at = i * 0.1 + (2.0 if gap_at is not None and i >= gap_at else 0.0)
        runs = i // 3 if stub_runs else 7
        return watch.Reading(at, 1.8e9, True, False, True, runs, IDLE, WAITING, server_runs=1000 + server_runs * i)

    assert [type(a) for a in observe_all([stale(i) for i in range(25)])] == [watch.StubLost]
    # Not across a gap in the guard's own readings: tritonserver's waiting thread may not have run either.
    assert [type(a) for a in observe_all([stale(i, gap_at=5) for i in range(15)])] == [watch.GuardGap]
    # Nor while tritonserver's threads do not run (starved: its waiting thread has not taken it yet).
    assert observe_all([stale(i, server_runs=0) for i in range(40)]) == []
    # Nor while the stub does not run: stopped inside its push, it has moved the queue's head but not
    # yet woken tritonserver (the guard is vouching for it meanwhile).
    assert observe_all([stale(i, stub_runs=False) for i in range(40)]) == []
    # Nor without tritonserver's run count.
    assert observe_all([reading(i * 0.1, parent_queue=WAITING) for i in range(40)]) == []
    # An answer Triton takes at once, or one while the stub has a message to read, is normal.
    taken = [reading(i * 0.1, parent_queue=WAITING if i % 2 else IDLE) for i in range(30)]
    assert observe_all(taken) == []
    busy = [reading(i * 0.1, parent_queue=WAITING, stub_queue=WAITING) for i in range(30)]
    assert observe_all(busy) == []
    finalizing = [reading(i * 0.1, parent_queue=WAITING, finalized=True) for i in range(30)]
    assert observe_all(finalizing) == []


def test_the_cause_of_a_crash_is_the_lost_stub_else_the_recent_stalls(tmp_path: Path) -> None:
    path = tmp_path / "stalls.jsonl"
    now = 1000.0
    for kind, instance, at in (("contained", "a_0_0", 990.0), ("guard_gap", "b_0_0", 995.0), ("died", "c_0_0", 900.0)):
        records.append(path, {"time": at, "kind": kind, "instance": instance, "message": f"{instance} {kind}"})
    found = records.read(path)
    assert [r.instance for r in found] == ["a_0_0", "b_0_0", "c_0_0"]
    assert records.crash_cause(found, now) == "b_0_0 guard_gap"
    records.append(path, {"time": 999.0, "kind": records.LOST, "instance": "d_0_0", "message": "d_0_0 is lost"})
    with path.open("a") as out:
        out.write('{"time": 99')  # cut short by a crash
    assert records.crash_cause(records.read(path), now) == "d_0_0 is lost"
    assert records.crash_cause([], now) is None


def test_a_stub_that_dies_after_the_wall_clock_stepped_forward_is_lost() -> None:
    # Triton 2.51 times its wait for a stub by the wall clock: a step forward ends a wait under way.
    steps = [reading(0.0), reading(0.05, wall=1.8e9 + 3.0, health=False), reading(0.1, wall=1.8e9 + 3.0, alive=False)]
    actions = observe_all(steps)
    assert [type(a) for a in actions] == [watch.ClockStep, watch.StubGone, watch.StubLost]
    assert isinstance(actions[0], watch.ClockStep) and actions[0].seconds == pytest.approx(3.0)
    # A step backward only makes Triton wait longer.
    assert observe_all(
        [reading(0.0), reading(0.05, wall=1.8e9 - 3.0), reading(0.1, wall=1.8e9 - 3.0, alive=False)]
    ) == [watch.StubGone(expected=False)]
