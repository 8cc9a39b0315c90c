"""`use_ipex: false`: a process that turns IPEX off before importing vLLM runs vLLM's CPU attention
without it (as on a host without the package) and refuses prefix caching naming both settings.

Each case runs in a fresh interpreter: turning IPEX off only works before vLLM or IPEX is imported,
and this test process has imported both. Real vLLM; the served check is in tests/e2e.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from triton_vllm_multistep.engine.cpu_attention import ipex_available


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(not ipex_available(), reason="IPEX is not installed (scripts/setup.sh installs it)")
def test_turned_off_before_vllm_loads_vllm_runs_without_ipex_and_refuses_prefix_caching_naming_both() -> None:
    out = run_python(
        """
        import importlib.util, sys
        from triton_vllm_multistep.engine.ipex_switch import turn_ipex_off
        turn_ipex_off()
        from vllm import EngineArgs
        from triton_vllm_multistep.engine import cpu_attention
        print("use_ipex", cpu_attention.ipex_available())
        print("find_spec", importlib.util.find_spec("intel_extension_for_pytorch"))
        print("kernels", cpu_attention.attention_kernels())
        args = EngineArgs(model="m", enable_prefix_caching=True)
        print("refusal", cpu_attention.prefix_caching_refusal(args, cpu_attention.ipex_available()))
        """
    )
    assert "use_ipex False" in out and "find_spec None" in out
    assert "kernels PyTorch SDPA (IPEX off: use_ipex)" in out
    assert "enable_prefix_caching=true needs Intel Extension for PyTorch" in out
    assert "config.pbtxt parameter use_ipex is false" in out


@pytest.mark.skipif(not ipex_available(), reason="IPEX is not installed (scripts/setup.sh installs it)")
def test_turning_it_off_after_it_was_imported_is_an_error() -> None:
    out = run_python(
        """
        import intel_extension_for_pytorch
        from triton_vllm_multistep.engine.ipex_switch import IpexAlreadyLoadedError, turn_ipex_off
        try:
            turn_ipex_off()
        except IpexAlreadyLoadedError as error:
            print("refused:", error)
        """
    )
    assert "refused: use_ipex=false cannot take effect" in out
