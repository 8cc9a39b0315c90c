"""A V1 model's torch.compile result reused from vLLM's compile cache at its next start on CPU.

vLLM 0.32 on torch 2.10+ saves each compiled model as an AOT artifact and loads it at the next
start; on CPU that load always fails (vllm/compilation/decorators.py: "Compiling model again due
to a load failure ... 'function' object has no attribute 'finalize_loading'": the CPU backend's
compiled function is a plain function), so every load of a compiled model compiled it again. With
vLLM's AOT path off (`VLLM_USE_AOT_COMPILE=0`) its older cache (Dynamo's and Inductor's) serves the
next start of the same model: measured, SmolLM2-135M's engine init took 57 s the first time and 20 s
the next, with the same tokens (docs/performance.md, Cold start). On GPU nothing is set.

Owns that one environment setting. The engine process sets it before vLLM's engine core starts (the
core, spawned, reads its inherited environment); an operator's own VLLM_USE_AOT_COMPILE wins.
"""

from __future__ import annotations

import os

AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


def use_loadable_compile_cache(environment: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Turn vLLM's AOT compile off unless the environment already says; True when this set it."""
    if AOT_COMPILE_ENV in environment:
        return False
    environment[AOT_COMPILE_ENV] = "0"
    return True
