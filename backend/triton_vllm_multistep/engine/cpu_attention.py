"""CPU attention settings: whether vLLM's TORCH_SDPA backend can use IPEX, and what follows from it.

Owns refusing settings whose kernels are missing on this host (prefix caching without Intel
Extension for PyTorch) and the CPU KV block size default; must not build or run the engine.
"""

from __future__ import annotations

import dataclasses
import logging

from vllm.engine.arg_utils import EngineArgs

from triton_vllm_multistep.engine.ipex_switch import ipex_turned_off

logger = logging.getLogger(__name__)

# vLLM picks 128-token blocks on CPU when IPEX is importable and 16 otherwise. Ours stays 16 either
# way: prefix caching shares whole blocks only (a 100-token system prompt never fills a 128-token
# block), and the KV cache's block count (preemption, num_gpu_blocks_override) means the same
# thing with and without IPEX.
CPU_DEFAULT_BLOCK_SIZE = 16

IPEX_REQUIREMENT = "intel-extension-for-pytorch==2.6.0"


def attention_kernels() -> str:
    """Which kernels vLLM's attention runs on this host, for the model's ready line."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "the GPU attention backend vLLM chose"
    if ipex_available():
        return "IPEX"
    return "PyTorch SDPA (IPEX off: use_ipex)" if ipex_turned_off() else "PyTorch SDPA (no IPEX)"


def ipex_available() -> bool:
    """Whether vLLM's CPU attention uses IPEX in this process (vLLM's own import test)."""
    from vllm.attention.ops.ipex_attn import _use_ipex

    return bool(_use_ipex)


def prefix_caching_refusal(engine_args: EngineArgs, has_ipex: bool) -> str | None:
    """Why `engine_args` cannot run on this CPU host, or None.

    vLLM 0.8.5's TORCH_SDPA backend runs every prefill of a prefix-caching engine through IPEX's
    `flash_attn_varlen_func`; without IPEX the engine loads and its first request fails.
    """
    if engine_args.enable_prefix_caching and not has_ipex:
        if ipex_turned_off():
            return (
                "enable_prefix_caching=true needs Intel Extension for PyTorch on CPU hosts (vLLM's CPU attention "
                "runs prefix-cached prefills with it) and config.pbtxt parameter use_ipex is false: set use_ipex "
                "to true (or auto, the default) or enable_prefix_caching to false"
            )
        return (
            "enable_prefix_caching=true needs Intel Extension for PyTorch on CPU hosts (vLLM's CPU attention "
            "runs prefix-cached prefills with it) and it is not importable here: install "
            f"{IPEX_REQUIREMENT} (scripts/setup.sh installs it) or set enable_prefix_caching to false"
        )
    return None


def with_cpu_attention_defaults(engine_args: EngineArgs) -> EngineArgs:
    """`engine_args` with the CPU block size default filled in (the user's choice is kept)."""
    if engine_args.block_size is not None:
        return engine_args
    return dataclasses.replace(engine_args, block_size=CPU_DEFAULT_BLOCK_SIZE)


def check_cpu_attention(engine_args: EngineArgs) -> tuple[EngineArgs, str | None]:
    """(engine args to build with, refusal or None) for a CPU host."""
    has_ipex = ipex_available()
    logger.info("CPU attention: TORCH_SDPA %s Intel Extension for PyTorch", "with" if has_ipex else "without")
    return with_cpu_attention_defaults(engine_args), prefix_caching_refusal(engine_args, has_ipex)
