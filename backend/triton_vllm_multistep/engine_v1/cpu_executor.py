"""On CPU hosts, vLLM's worker inside its engine core process, its threads placed as vLLM places its worker's.

vLLM 0.32 on CPU runs its worker in a process of its own beside the engine core (its CPU platform
turns "uni" into "mp", vllm/platforms/cpu.py), the two handing each step over through a
shared-memory ring whose readers spin for a second after each message (shm_broadcast.SpinCondition;
vLLM's own "TODO: make scheduler proc sleep when idle"): the core's spin holds a CPU the rest of the
server needs, which on a small host is most of what it has (docs/performance.md, "vLLM's spinning
core and worker"). vLLM's UniProcExecutor named by its qualified name (which that platform check
leaves as it is) runs the worker in the core process instead: no ring and no spin. The core process
gets the OpenMP settings vLLM's MP executor gives its worker (OMPProcessManager: OMP_NUM_THREADS and
the CPUs of VLLM_CPU_OMP_THREADS_BIND, "auto" leaving one for the rest), set in this process's
environment while the core is spawned: the same kernels on the same number of threads, the same tokens
(tests/e2e/test_v1_served.py against `vllm serve`).

Owns that choice: on CPU, for one worker (no tensor, pipeline or data parallelism) when model.json
names no executor. On GPU vLLM's own choice stands (UniProcExecutor already, for one GPU). And, once
the core runs, its threads that only inherited that placement (free_inherited_threads): the forward
pass keeps its CPUs, the core's request intake and output get the engine process's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Not "uni", which vLLM 0.32's CPU platform replaces with "mp".
WORKER_IN_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
# "placed" keeps every thread of the core process where vLLM's placement puts its main thread (the
# forward pass's CPUs); by default its other threads that inherited that placement (request intake and
# output, ZeroMQ's, gloo's) are given back the CPUs of the engine process.
CORE_THREADS_ENV = "TRITON_VLLM_MULTISTEP_V1_CORE_THREADS"


def runs_worker_in_core(engine_args: Any) -> bool:
    """Whether this CPU engine's worker goes into its core process: one worker, no executor chosen in model.json."""
    workers = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size * engine_args.data_parallel_size
    return engine_args.distributed_executor_backend is None and workers == 1


@contextmanager
def core_threads_placed(vllm_config: Any) -> Iterator[None]:
    """This process's environment, while vLLM spawns the engine core, holding the OpenMP settings vLLM's
    MP executor would give its worker (restored after)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


def free_inherited_threads(core_pid: int, cpus: set[int]) -> int:
    """The threads of the core process that only inherited its main thread's placement, onto `cpus`
    (OpenMP's own threads are placed on CPUs of their own, so they keep theirs); returns how many moved.

    Why: under vLLM's placement the core's request intake and output threads wait for the CPU the
    forward pass holds (read from /proc: every thread of the core allowed CPU 0 only), while the rest of
    the server has the other CPU. Set with `CORE_THREADS_ENV=placed` to keep vLLM's placement."""
    if os.environ.get(CORE_THREADS_ENV, "") == "placed":
        return 0
    tasks = Path(f"/proc/{core_pid}/task")
    try:
        main = os.sched_getaffinity(core_pid)
        tids = [int(task.name) for task in tasks.iterdir()]
    except (ProcessLookupError, FileNotFoundError):
        return 0
    if main >= cpus:
        return 0  # not placed narrower than this process: nothing inherited a narrower placement
    moved = 0
    for tid in tids:
        try:
            if tid != core_pid and os.sched_getaffinity(tid) == main:
                os.sched_setaffinity(tid, cpus)
                moved += 1
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    logger.info("engine core %d: %d thread(s) besides the forward pass's moved onto CPUs %s", core_pid, moved, cpus)
    return moved


def core_process_ids() -> list[int]:
    """This process's child processes (vLLM's engine core is the one it starts)."""
    children: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            children += [int(pid) for pid in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children
