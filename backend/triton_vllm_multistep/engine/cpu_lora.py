"""LoRA on vLLM 0.8.5's CPU engine: rows of no adapter (the base model) get no adapter, and each
adapter's rows are computed together.

Owns the CPU punica wrapper installed on a built CPU engine (any num_scheduler_steps): the
correction for rows without an adapter, and grouped LoRA matmuls; must not change what a row's
LoRA term is (x @ A.T * scale @ B.T of its adapter, 0 without one), and is never used on CUDA,
whose punica kernels skip those rows themselves.

Why: vLLM marks a row without an adapter with slot index -1 (lora/punica_wrapper/utils.py
`convert_mapping`). Its CPU ops (lora/ops/torch_ops/lora_ops.py) gather the stacked weights with
that index, and -1 selects the LAST slot: when an adapter occupies it, every base-model row of
the batch gets that adapter (with `max_loras` 1, any base request beside an adapter request), at
steps 1 as at steps 8 (vLLM PR 48421 describes the same defect). The wrapper's ops below skip
those rows (linear layers, the embedding, the logits), so their LoRA term is exactly 0, as on CUDA.

Why grouped: vLLM's CPU ops gather every row's adapter weights (`lora_b_weights[indices]`, a
[rows, out, in] copy per projection, per layer, per step; for the logits [rows, vocabulary, rank])
and contract them with an einsum; on SmolLM2-135M at 32 rows that was ~200 ms of a ~250 ms forward
pass, paid by base-model rows too (benchmarks/lora_throughput.py). The wrapper's ops below instead
run one matmul per adapter present, over that adapter's rows, and none for rows without an adapter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

logger = logging.getLogger(__name__)


# (adapter slot, its rows; None when the slot has every row) for each slot present
SlotRows = list[tuple[int, torch.Tensor | None]]


def slot_rows(indices: torch.Tensor) -> SlotRows:
    """Group the rows of a batch by adapter slot; rows of index -1 (no adapter) are in no group."""
    slots = [slot for slot in torch.unique(indices).tolist() if slot >= 0]
    if len(slots) == 1 and bool((indices == slots[0]).all()):
        return [(slots[0], None)]
    return [(slot, (indices == slot).nonzero().squeeze(1)) for slot in slots]


def grouped_lora_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor | SlotRows,
    out: torch.Tensor,
    scale: float,
    add: bool,
) -> None:
    """out[t] (+)= scale * x[t] @ weights[indices[t]].T, one matmul per adapter slot present; rows of
    index -1 (no adapter) get nothing added (0 when not adding). `weights`: [slots, (1,) out, in];
    `indices`: per-row slots, or their `slot_rows` grouping."""
    rows_count = sum(0 if rows is None else len(rows) for _, rows in indices) if isinstance(indices, list) else None
    if x.shape[0] != out.shape[0] or (rows_count is None and indices.shape[0] != x.shape[0]):
        count = indices.shape[0] if rows_count is None else rows_count
        raise ValueError(f"LoRA rows disagree: x {tuple(x.shape)}, out {tuple(out.shape)}, {count} indices")
    groups = indices if isinstance(indices, list) else slot_rows(indices)
    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    if not add:
        out.zero_()
    for slot, rows in groups:
        inputs = x if rows is None else x.index_select(0, rows)
        product = inputs.to(out.dtype) @ stacked[slot].to(out.dtype).T
        if scale != 1.0:
            product.mul_(scale)
        if rows is None:
            out.add_(product)
        else:
            out.index_add_(0, rows, product)


class BaseRowsPunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's PunicaWrapperCPU with no LoRA term for rows that have no adapter (index -1), and its
    linear and embedding ops grouped by adapter (`grouped_lora_matmul`)."""

    def _decode_rows(self, indices: torch.Tensor) -> SlotRows:
        """`slot_rows` of the wrapper's per-token or sampler indices, computed once per mapping: vLLM
        refills these buffers in place when the mapping changes (which bumps their version)."""
        key = (indices.data_ptr(), indices.shape[0], indices._version)
        cache: dict[tuple[int, int, int], SlotRows] = self.__dict__.setdefault("_slot_rows_cache", {})
        if key not in cache:
            if len(cache) > 8:
                cache.clear()
            cache[key] = slot_rows(indices)
        return cache[key]

    def _token_rows(self) -> SlotRows:
        return self._decode_rows(self.token_lora_indices)

    def _prefill_indices(self) -> torch.Tensor:
        """Per-token slots of a prefill batch, as vLLM's sgmv ops expand them."""
        _, seq_lens, slots, *_ = self.prefill_metadata
        return torch.repeat_interleave(slots, seq_lens)

    def _shrink_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> None:
        if not self.no_lora:
            grouped_lora_matmul(x, w_t_all, self._prefill_indices(), y[:, : w_t_all.shape[-2]], scale, add=False)

    def _shrink_decode(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> None:
        grouped_lora_matmul(x, w_t_all, self._token_rows(), y[:, : w_t_all.shape[-2]], scale, add=False)

    def _expand_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, add_inputs: bool) -> None:
        if not self.no_lora:
            grouped_lora_matmul(x, w_t_all, self._prefill_indices(), y[:, : w_t_all.shape[-2]], 1.0, add_inputs)

    def _expand_decode(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, add_inputs: bool) -> None:
        grouped_lora_matmul(x, w_t_all, self._token_rows(), y[:, : w_t_all.shape[-2]], 1.0, add_inputs)

    def _expand_slice_prefill(
        self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, offset: int, size: int, add_inputs: bool
    ) -> None:
        if not self.no_lora:
            grouped_lora_matmul(x, w_t_all, self._prefill_indices(), y[:, offset : offset + size], 1.0, add_inputs)

    def _expand_slice_decode(
        self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, offset: int, size: int, add_inputs: bool
    ) -> None:
        grouped_lora_matmul(x, w_t_all, self._token_rows(), y[:, offset : offset + size], 1.0, add_inputs)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """vLLM's `y += (x @ A.T * scale) @ B.T` per row of the sampler's adapter, grouped: its CPU
        version gathers a [rows, vocabulary, rank] copy of B for every step."""
        y_rows = y.view(-1, y.shape[-1])
        x_rows = x.view(-1, x.shape[-1])
        rank = lora_b_stacked.size(-1)
        if buffer is None:
            buffer = torch.zeros((x_rows.size(0), rank), dtype=torch.float32, device=x_rows.device)
        indices = self._decode_rows(self.sampler_indices)
        grouped_lora_matmul(x_rows, lora_a_stacked, indices, buffer[:, :rank], scale, add=False)
        grouped_lora_matmul(buffer, lora_b_stacked, indices, y_rows[:, : lora_b_stacked.shape[-2]], 1.0, add=True)


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
