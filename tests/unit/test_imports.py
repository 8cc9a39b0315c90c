"""Import rules that a static check cannot see: what importing a module loads at run time.

Triton runs `auto_complete_config` in a stub process of its own; a module-level vLLM or torch
import on that path costs ~7 s per model load. Host tools (launcher, CLI) must start fast too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("vllm", "torch", "transformers")


def _loaded_after_import(*modules: str) -> list[str]:
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(json.dumps(sorted(n for n in {HEAVY!r} if n in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "triton_vllm_multistep.stub.instance",  # the entry point's import, auto_complete included
        "triton_vllm_multistep.stub.tokenizer_stages",
        "triton_vllm_multistep.stub.responder",
        "triton_vllm_multistep.stub.metrics",
        "triton_vllm_multistep.host.cli",
        "triton_vllm_multistep.lifecycle.drain",
        "triton_vllm_multistep.lifecycle.server_drain",
        "triton_vllm_multistep.engine.events",
        "triton_vllm_multistep.engine.engine_args",  # the stub imports it before IPEX is off
        "triton_vllm_multistep.settings",  # read by the stub, the OpenAI front end and the tools
        "triton_vllm_multistep.interface",
    ],
)
def test_module_imports_no_heavy_framework(module: str) -> None:
    assert _loaded_after_import(module) == []


def test_the_check_sees_a_heavy_import() -> None:
    # The probe itself must be able to fail.
    assert "torch" in _loaded_after_import("triton_vllm_multistep.testing.step_timing")
