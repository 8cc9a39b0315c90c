"""The shared memory a Triton 2.51 Python stub and tritonserver talk through, read from outside.

Owns where python_backend r24.10 keeps the stub's health flag and its two command queues, and
checking that a region really has that layout; must not decide anything (stubguard/watch.py does).
Layout (python_backend r24.10, src/pb_utils.h, src/message_queue.h, src/shm_manager.h): every
object the backend puts in the region is preceded by a 16-byte AllocatedShmOwnership, and a
handle is the object's offset from the region's start. The stub's argv gives the region's name
(argv[2]) and the IPCControlShm handle (argv[7]):

    IPCControlShm    +0 bool stub_health, +1 parent_health, +2 uses_env, +3 decoupled,
                     +8 parent_health_mutex, +48 stub_health_mutex (pthread, 40 bytes),
                     +88 handles: stub_message_queue, parent_message_queue, ... (int64 each)
    MessageQueueShm  +0 sem_empty, +32 sem_full (sem_t), +64 mutex, +104 size_t size,
                     +112 buffer handle, +120 int head, +124 int tail
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

OWNERSHIP_BYTES = 16  # alignas(16) AllocatedShmOwnership { uint32_t ref_count_; }
STUB_HEALTH = 0
DECOUPLED = 3
STUB_HEALTH_MUTEX = 48
PTHREAD_MUTEX_KIND = 16  # offset of __kind in glibc's x86_64 pthread_mutex_t
ROBUST_SHARED_KIND = 0x90  # PTHREAD_MUTEX_ROBUST | PTHREAD_MUTEX_PSHARED_BIT: boost's interprocess_mutex
QUEUE_HANDLES = 88
QUEUE_SIZE, QUEUE_HEAD, QUEUE_TAIL = 104, 120, 124
SHM_DIR = Path("/dev/shm")
# What the guard maps: the region's first bytes hold the control block and the queues' heads.
MAPPED_BYTES = 64 * 1024


class LayoutError(RuntimeError):
    """The region does not have python_backend r24.10's layout (another Triton release)."""


@dataclass(frozen=True)
class StubArguments:
    """What a stub's command line says about its shared memory."""

    region: str
    control_handle: int
    instance: str  # Triton's model instance name, e.g. postprocessing_0_0


def stub_arguments(argv: list[str]) -> StubArguments:
    """Parse triton_python_backend_stub's argv (model path, region, default size, growth size,
    parent pid, install path, IPCControl handle, instance name, runtime model dir)."""
    if len(argv) < 9 or not argv[0].endswith("triton_python_backend_stub"):
        raise LayoutError(f"not a Triton Python stub's command line: {argv[:1]}")
    try:
        return StubArguments(region=argv[2], control_handle=int(argv[7]), instance=argv[8])
    except ValueError:
        raise LayoutError(f"argv[7] is not an IPCControl handle: {argv[7]!r}") from None


@dataclass(frozen=True)
class QueueState:
    head: int
    tail: int
    size: int

    @property
    def depth(self) -> int:
        return (self.head - self.tail) % self.size


class StubControl:
    """A stub's IPCControl block and command queues, mapped from /dev/shm."""

    def __init__(self, region: mmap.mmap, control_handle: int) -> None:
        self._region = region
        self._control = control_handle + OWNERSHIP_BYTES
        handles = struct.unpack_from("2q", region, self._control + QUEUE_HANDLES)
        self._stub_queue, self._parent_queue = (handle + OWNERSHIP_BYTES for handle in handles)

    @classmethod
    def open(cls, arguments: StubArguments, shm_dir: Path = SHM_DIR) -> StubControl:
        """Map the stub's region and check its layout (raises LayoutError, OSError)."""
        fd = os.open(shm_dir / arguments.region, os.O_RDWR)
        try:
            size = min(os.fstat(fd).st_size, MAPPED_BYTES)
            region = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        control = cls(region, arguments.control_handle)
        control.check()
        return control

    def check(self) -> None:
        """The checks that tell r24.10's layout from another: the control block's four flags are bools,
        the stub's health mutex is a robust process-shared pthread mutex, both queues are sane. (Not
        whether the decoupled flag is the model's: the guard starts at model.py's import, before the
        stub has the model's configuration, and the auto-complete stub's flag predates it.)"""
        region = self._region
        if self._control + QUEUE_HANDLES + 16 > len(region):
            raise LayoutError(f"IPCControl at {self._control} lies outside the mapped {len(region)} bytes")
        flags = bytes(region[self._control + STUB_HEALTH : self._control + DECOUPLED + 1])
        if any(flag > 1 for flag in flags):
            raise LayoutError(f"the control block's flags read {list(flags)}, not bools")
        kind = struct.unpack_from("i", region, self._control + STUB_HEALTH_MUTEX + PTHREAD_MUTEX_KIND)[0]
        if kind != ROBUST_SHARED_KIND:
            raise LayoutError(f"the stub's health mutex has kind {kind:#x}, not {ROBUST_SHARED_KIND:#x}")
        for name, offset in (("stub", self._stub_queue), ("parent", self._parent_queue)):
            if offset + QUEUE_TAIL + 4 > len(region):
                raise LayoutError(f"the {name} message queue at {offset} lies outside the mapped bytes")
            state = self._queue(offset)
            if not (0 < state.size <= 1 << 20 and 0 <= state.head < state.size and 0 <= state.tail < state.size):
                raise LayoutError(
                    f"the {name} message queue reads size {state.size}, head {state.head}, tail {state.tail}"
                )

    @property
    def stub_health(self) -> bool:
        return bool(self._region[self._control + STUB_HEALTH])

    def vouch(self) -> None:
        """Set the flag the stub's health thread sets every 300 ms. One byte store, no lock: holding
        the stub's robust health mutex from here would make a guard killed while holding it abort
        tritonserver (its next lock would see the owner dead)."""
        self._region[self._control + STUB_HEALTH] = 1

    def stub_queue(self) -> QueueState:
        """Messages from tritonserver to the stub (execute, then one dummy after each answer)."""
        return self._queue(self._stub_queue)

    def parent_queue(self) -> QueueState:
        """The stub's answers to tritonserver."""
        return self._queue(self._parent_queue)

    def _queue(self, offset: int) -> QueueState:
        size = struct.unpack_from("q", self._region, offset + QUEUE_SIZE)[0]
        head, tail = struct.unpack_from("2i", self._region, offset + QUEUE_HEAD)
        return QueueState(head=head, tail=tail, size=max(size, 1))

    def close(self) -> None:
        self._region.close()
