"""Starting this stub's guard (stubguard/: a process of its own that keeps tritonserver from giving up
on the stub while it stalls) and telling it when the stub's exit is expected.

Owns the guard process's start and its one message; must not do anything the guard does. Started
when the stub imports its model.py (the LLM model's and the ensemble's tokenizer stages'), not in
`initialize`: Triton runs every Python model's `auto_complete_config` in a stub of its own first and
applies its one-second rule to that stub too (it SIGKILLs one whose health flag stayed down for a
second, and a stub killed inside Triton's shared-memory allocator aborts tritonserver), and the
load of a model instance is covered from its first line.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys

from triton_vllm_multistep.engine.process import python_for_children
from triton_vllm_multistep.lifecycle import procfs
from triton_vllm_multistep.stub import stall_detector
from triton_vllm_multistep.stubguard import ipc
from triton_vllm_multistep.stubguard.guard import ENTRY_MODULE, FINALIZING, health_thread, keep_running

logger = logging.getLogger("triton_vllm_multistep")
# Off only to show what happens without it (tests/stress, docs/lifecycle.md): "0".
ENABLED_ENV = "TRITON_VLLM_MULTISTEP_STUB_GUARD"


class StallGuard:
    """This stub's guard process; `finalizing()` before the stub exits, so its exit is not a loss."""

    def __init__(self, process: subprocess.Popen[bytes] | None) -> None:
        self._process = process

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def finalizing(self) -> None:
        if self._process is None or self._process.stdin is None:
            return
        try:
            self._process.stdin.write(FINALIZING)
            self._process.stdin.flush()
        except (OSError, ValueError):  # the guard is gone already, or the pipe closed
            pass


_this_stub: StallGuard | None = None


def guard_this_stub() -> StallGuard:
    """This stub's guard, started on the first call (at model.py's import); later calls return it.
    An exit through the interpreter's end (a stub finalized by Triton, the auto-complete stub's
    included) is announced to it."""
    global _this_stub
    if _this_stub is None:
        _this_stub = start()
        atexit.register(_this_stub.finalizing)
    return _this_stub


def start_for(args: dict[str, str]) -> StallGuard:
    """In `initialize`: the guard (started at import already) and the diagnostic stall detector
    (stub/stall_detector.py) when the environment asks for it."""
    config = json.loads(args["model_config"])
    stall_detector.start_from_environment(args.get("model_instance_name") or config.get("name", "?"))
    return guard_this_stub()


def start() -> StallGuard:
    """Start the guard for this process (a Triton stub); a guard that cannot start is logged, not fatal:
    the stub serves as it would without one."""
    try:
        ipc.stub_arguments(procfs.cmdline(os.getpid()))
    except ipc.LayoutError:  # not in a Triton stub (a test of the model's code): nothing to guard
        return StallGuard(None)
    if os.environ.get(ENABLED_ENV, "1") == "0":
        logger.warning("stub guard off (%s=0): a stall of this stub over 1 s can abort tritonserver", ENABLED_ENV)
        return StallGuard(None)
    # The health thread at real-time priority now, from inside, as the guard does once it runs: the
    # guard's own start (a Python process) takes long enough on a busy host for Triton's one-second
    # rule to kill a starved stub first (seen: an auto-complete stub at a reload, CPU pressure 95%).
    health = health_thread(os.getpid())
    if health is not None:
        keep_running(health)
    python = python_for_children()
    if python is None:
        logger.warning("no stub guard: no Python %d.%d found to run it", *sys.version_info[:2])
        return StallGuard(None)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    try:
        process = subprocess.Popen(
            [python, "-m", ENTRY_MODULE, str(os.getpid())], stdin=subprocess.PIPE, env=environment
        )
    except OSError as error:
        logger.warning("no stub guard: %s", error)
        return StallGuard(None)
    return StallGuard(process)
