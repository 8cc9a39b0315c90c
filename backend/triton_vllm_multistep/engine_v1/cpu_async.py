"""Async scheduling on CPU, where model.json asks for it.

vLLM 0.32's CPU platform turns `async_scheduling` off whatever the engine arguments say
(vllm/platforms/cpu.py `check_and_update_config`: "async scheduling is not required on CPU"), so a
model.json `async_scheduling: true` would silently mean nothing. Forced on, the CPU engine overlaps
scheduling the next step with the current one and serves the same tokens (tests/e2e/
test_v1_served.py serves the tiny model with it against `vllm serve` without it; figures in
docs/performance.md). On GPU vLLM decides as it always does (on by default where supported).

Owns keeping an explicit `async_scheduling: true` after the CPU platform's check. vLLM 0.32 spawns
its engine core on CPU, which imports the engine process's main module again (engine_v1/process.py):
that module installs this at import when KEEP_ENV is set, as the engine process sets it (and the
core inherits it) before it builds such an engine.
"""

from __future__ import annotations

from typing import Any

# Set by the V1 engine process for a CPU engine with async_scheduling true; read at its module's import.
KEEP_ENV = "TRITON_VLLM_MULTISTEP_V1_CPU_ASYNC_SCHEDULING"


def keep_async_scheduling() -> None:
    """Wrap the CPU platform's config check so that it leaves async scheduling on; once per process."""
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config
    if getattr(checked, "keeps_async_scheduling", False):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        checked.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.keeps_async_scheduling = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
