"""vLLM 0.32's LoRA on CPU, made exact for base requests batched with adapter requests.

Its CPU punica ops (vllm/lora/ops/torch_ops/lora_ops.py) pick each token's adapter weights with
`weights[lora_indices]`, and a base request's tokens have index -1: Python's last slot, the
weights of whichever adapter sits there. A base request alone is right (no adapter loaded, the
slots are zero), but in a batch with adapter requests it gets an adapter's delta: measured on the
tiny model, greedy, a base request batched with two adapters' differed from itself alone from its
second token (tests/e2e/test_v1_served.py). GPU kernels skip index -1; only the CPU ops are patched.

Owns the one fix: the LoRA shrink (x·A, the first half of every LoRA product) writes zeros for
tokens without an adapter, so the expand (·B) adds exactly 0 to them, as no LoRA at all. vLLM 0.32
starts its engine core on CPU by spawn, which imports the engine process's main module again
(engine_v1/process.py) in the core: that module installs the fix at import when FIX_ENV is set, which
the engine process sets (and inherits to the core) before it builds a CPU LoRA engine.
"""

from __future__ import annotations

from typing import Any

# Set by the V1 engine process for a CPU engine with LoRA; read at its module's import, in the core too.
FIX_ENV = "TRITON_VLLM_MULTISTEP_V1_CPU_LORA_FIX"


def exact_base_rows_in_mixed_batches() -> None:
    """Patch vLLM's CPU `bgmv_shrink` where it is looked up (the ops module, the package and the CPU
    punica wrapper); once per process."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    original = lora_ops.bgmv_shrink
    if getattr(original, "exact_base_rows", False):
        return

    def bgmv_shrink(
        inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any, scaling: float = 1.0
    ) -> None:
        original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        base = lora_indices_tensor < 0
        if bool(base.any()):
            output_tensor[: base.shape[0]][base] = 0

    bgmv_shrink.exact_base_rows = True  # type: ignore[attr-defined]
    for module in (lora_ops, torch_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink
