"""LoRA on vLLM 0.8.5's CPU engine: rows of no adapter (the base model) get no adapter.

Owns the correction of vLLM's CPU punica wrapper for rows without an adapter, installed on a built
CPU engine (any num_scheduler_steps); must not change what rows with an adapter compute, and is
never used on CUDA, whose punica kernels skip those rows themselves.

Why: vLLM marks a row without an adapter with slot index -1 (lora/punica_wrapper/utils.py
`convert_mapping`). Its CPU ops (lora/ops/torch_ops/lora_ops.py) gather the stacked weights with
that index, and -1 selects the LAST slot: when an adapter occupies it, every base-model row of
the batch gets that adapter (with `max_loras` 1, any base request beside an adapter request), at
steps 1 as at steps 8 (vLLM PR 48421 describes the same defect). The wrapper below zeroes the
input of the expand ops for those rows (the shrink buffers, the embedding's A lookup and the
logits' shrink input), so their LoRA term is exactly 0, as on CUDA.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

logger = logging.getLogger(__name__)


def _without_rows(x: Any, rows: torch.Tensor) -> Any:
    """`x` (a tensor of rows, or of slices of rows, or a tuple of either) with `rows` zeroed, as a copy."""
    if isinstance(x, tuple | list):
        return type(x)(_without_rows(t, rows) for t in x)
    mask = rows.view(-1, 1) if x.dim() == 2 else rows.view(1, -1, 1)
    return x.masked_fill(mask, 0)


class BaseRowsPunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's PunicaWrapperCPU with no LoRA term for rows that have no adapter (index -1)."""

    def add_expand(self, y: torch.Tensor, x: Any, *args: Any, **kwargs: Any) -> None:
        base = self.token_lora_indices == -1
        super().add_expand(y, _without_rows(x, base) if bool(base.any()) else x, *args, **kwargs)

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        base = self.token_lora_indices == -1
        super().add_lora_embedding(y, _without_rows(x, base) if bool(base.any()) else x, *args, **kwargs)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        base = self.sampler_indices == -1
        if bool(base.any()):
            x = _without_rows(x.view(-1, x.shape[-1]), base)
        super().add_lora_logits(y, x, *args, **kwargs)


def correct_base_rows(engine: Any) -> bool:
    """Give a built CPU engine's LoRA layers the corrected wrapper; False if it has no LoRA.

    The manager's one wrapper object is shared by every LoRA layer (`set_mapping`) and holds all
    the mapping state; its class is swapped in place (the subclass adds no state), so every
    layer sees the correction without being rebuilt.
    """
    worker = getattr(getattr(engine.model_executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    wrapper = getattr(manager, "punica_wrapper", None)
    if wrapper is None:
        return False
    if type(wrapper) is not PunicaWrapperCPU:
        raise TypeError(f"expected vLLM's PunicaWrapperCPU on a CPU engine with LoRA, found {type(wrapper).__name__}")
    wrapper.__class__ = BaseRowsPunicaWrapperCPU
    logger.info("LoRA on CPU: rows without an adapter are kept free of the last slot's adapter")
    return True
