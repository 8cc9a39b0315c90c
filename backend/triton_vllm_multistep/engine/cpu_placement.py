"""Which of the host's CPUs a model's engine process runs on, and keeping other threads off them.

config.pbtxt `engine_cpus` (a Linux CPU list: "3", "2-7", "0,2-3") gives the engine process those
CPUs for every thread it has (its torch threads then number one per CPU, bound by vLLM's own
VLLM_CPU_OMP_THREADS_BIND on CPU hosts) and moves the stub's threads (the responder that builds
and sends the responses, the reader of the engine's events) to the CPUs it had minus those. Why:
served per step, the engine's forward pass shares the cores with the response path, and its
OpenMP barriers wait for any thread descheduled for it (docs/performance.md, "Engine placement").
Imports neither vLLM nor torch: the engine process applies it before it imports them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

# CPU lists are read where config.pbtxt is (settings/cpus.py); their names stay reachable from here.
from triton_vllm_multistep.settings.cpus import CpuListError, allowed_cpus, cpu_list_text, parse_cpu_list

# The argument by which an engine process is told it keeps the CPUs it inherited.
ALL_CPUS = "all"
# The environment variables by which a user chooses the engine's threads (theirs always win).
THREAD_ENVIRONMENT = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def thread_choice_of_user() -> dict[str, str | None]:
    """The user's thread settings, read before the engine is built: vLLM's CPU platform sets
    OMP_NUM_THREADS itself while it builds the config, after which its value says nothing of the user."""
    return {name: os.environ.get(name) for name in THREAD_ENVIRONMENT}


def placement_refusal(cpus: tuple[int, ...]) -> str | None:
    """Why this host will not run a thread on exactly `cpus` (None: it will). Tried on a thread of its
    own, so nothing else moves: a server started with `taskset` may still give its engine CPUs
    outside its own affinity, as long as its cgroup's cpuset holds them."""
    outcome: list[str | None] = []

    def try_them() -> None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as error:
            outcome.append(f"sched_setaffinity: {error.strerror}")
            return
        placed = tuple(sorted(os.sched_getaffinity(0)))
        outcome.append(None if placed == cpus else f"the kernel allowed only CPU {cpu_list_text(placed)}")

    probe = threading.Thread(target=try_them, name="engine_cpus probe")
    probe.start()
    probe.join()
    return outcome[0] if outcome else "the probe thread failed"


def check_engine_cpus(
    cpus: tuple[int, ...], user_threads: Mapping[str, str | None], threads_bound: bool = True
) -> None:
    """Raise CpuListError when `cpus` cannot be the engine's: CPUs this server may not run on, or a
    thread setting of the user's (thread_choice_of_user) that says otherwise where the
    engine's torch threads are bound to `cpus` (`threads_bound`: vLLM's CPU worker; GPU workers
    ignore VLLM_CPU_OMP_THREADS_BIND, so there the user's thread settings stand)."""
    refusal = placement_refusal(cpus)
    if refusal:
        raise CpuListError(
            f"engine_cpus {cpu_list_text(cpus)} names CPUs this server may not run on ({refusal}; "
            f"CPUs it runs on now: {cpu_list_text(allowed_cpus())})"
        )
    if not threads_bound:
        return
    bind = user_threads.get("VLLM_CPU_OMP_THREADS_BIND") or ALL_CPUS
    if bind != ALL_CPUS and set(parse_cpu_list(bind)) != set(cpus):
        raise CpuListError(
            f"engine_cpus {cpu_list_text(cpus)} disagrees with VLLM_CPU_OMP_THREADS_BIND={bind} in the "
            "server's environment: set one of them"
        )
    threads = user_threads.get("OMP_NUM_THREADS")
    if threads and threads.strip() != str(len(cpus)):
        raise CpuListError(
            f"engine_cpus {cpu_list_text(cpus)} runs {len(cpus)} torch thread(s) but OMP_NUM_THREADS={threads} "
            "in the server's environment: set one of them"
        )


def engine_thread_environment(cpus: tuple[int, ...]) -> dict[str, str]:
    """What the engine process's environment gets for `cpus`: vLLM's CPU worker binds one torch
    thread to each of them (GPU workers do not read it)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list_text(cpus)}


def pin_process(cpus: Iterable[int]) -> None:
    """Every thread of this process (and those it starts later) onto `cpus`."""
    chosen = set(cpus)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), chosen)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, chosen)  # the calling thread, which threads started later inherit


def thread_cpus(pid: int) -> dict[int, tuple[int, ...]]:
    """Each thread of process `pid` with the CPUs it may run on (for tests and tools)."""
    cpus: dict[int, tuple[int, ...]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpus[int(task.name)] = tuple(sorted(os.sched_getaffinity(int(task.name))))
        except ProcessLookupError:
            continue
    return cpus
