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
names no executor. On GPU vLLM's own choice stands (UniProcExecutor already, for one GPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Not "uni", which vLLM 0.32's CPU platform replaces with "mp".
WORKER_IN_CORE_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


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
