"""The grouped CPU LoRA matmul (engine/cpu_lora.py) against vLLM 0.8.5's own CPU ops, row by row.

Rows with an adapter get exactly what vLLM's bgmv ops give them (up to float32 summation order);
rows without one (index -1) get no LoRA term, where vLLM's ops give them the last slot's adapter.
"""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_expand_slice, bgmv_shrink

from triton_vllm_multistep.engine.cpu_lora import grouped_lora_matmul, slot_rows

SLOTS, RANK, HIDDEN, OUT = 3, 8, 48, 80
INDICES = torch.tensor([0, 2, -1, 1, 2, -1, 0, 0])


def _weights(out: int, inner: int, seed: int) -> torch.Tensor:
    return torch.randn(SLOTS, 1, out, inner, generator=torch.Generator().manual_seed(seed))


def _assert_rows(ours: torch.Tensor, vllms: torch.Tensor, without: torch.Tensor) -> None:
    with_adapter = INDICES >= 0
    torch.testing.assert_close(ours[with_adapter], vllms[with_adapter], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[~with_adapter], without[~with_adapter], rtol=0, atol=0)


def test_shrink_equals_vllms_for_rows_with_an_adapter_and_is_zero_without() -> None:
    x = torch.randn(len(INDICES), HIDDEN, generator=torch.Generator().manual_seed(1))
    lora_a = _weights(RANK, HIDDEN, 2)
    ours, vllms = torch.full((len(INDICES), RANK), 7.0), torch.full((len(INDICES), RANK), 7.0)
    grouped_lora_matmul(x, lora_a, INDICES, ours, 0.5, add=False)
    bgmv_shrink(x, lora_a, vllms, INDICES, 0.5)
    _assert_rows(ours, vllms, torch.zeros_like(ours))
    # vLLM's own op gives rows without an adapter the last slot's (why the correction exists).
    torch.testing.assert_close(vllms[INDICES == -1], 0.5 * x[INDICES == -1] @ lora_a[-1, 0].T)


@pytest.mark.parametrize("add", [True, False])
def test_expand_and_expand_slice_equal_vllms_for_rows_with_an_adapter(add: bool) -> None:
    x = torch.randn(len(INDICES), RANK, generator=torch.Generator().manual_seed(3))
    lora_b = _weights(OUT, RANK, 4)
    start = torch.randn(len(INDICES), OUT + 16, generator=torch.Generator().manual_seed(5))
    ours, vllms = start.clone(), start.clone()
    grouped_lora_matmul(x, lora_b, INDICES, ours[:, :OUT], 1.0, add)
    bgmv_expand(x, lora_b, vllms, INDICES, add)
    without = start.clone()
    if not add:
        without[:, :OUT] = 0
    _assert_rows(ours, vllms, without)
    ours, vllms = start.clone(), start.clone()
    grouped_lora_matmul(x, lora_b, INDICES, ours[:, 16 : 16 + OUT], 1.0, add)
    bgmv_expand_slice(x, lora_b, vllms, INDICES, 16, OUT, add)
    without = start.clone()
    if not add:
        without[:, 16 : 16 + OUT] = 0
    _assert_rows(ours, vllms, without)


def test_rows_that_disagree_are_an_error_not_a_silent_broadcast() -> None:
    with pytest.raises(ValueError, match="LoRA rows disagree"):
        grouped_lora_matmul(torch.zeros(2, RANK), _weights(OUT, RANK, 6), INDICES, torch.zeros(2, OUT), 1.0, True)


def test_precomputed_slot_rows_and_a_batch_of_one_adapter_give_the_same_result() -> None:
    x = torch.randn(len(INDICES), HIDDEN, generator=torch.Generator().manual_seed(7))
    lora_a = _weights(RANK, HIDDEN, 8)
    direct, grouped = torch.zeros(len(INDICES), RANK), torch.zeros(len(INDICES), RANK)
    grouped_lora_matmul(x, lora_a, INDICES, direct, 2.0, add=False)
    grouped_lora_matmul(x, lora_a, slot_rows(INDICES), grouped, 2.0, add=False)
    torch.testing.assert_close(direct, grouped, rtol=0, atol=0)
    same = torch.full((len(INDICES),), 1)
    assert slot_rows(same) == [(1, None)]  # every row one adapter: no gather, no scatter
    whole, vllms = torch.zeros(len(INDICES), RANK), torch.zeros(len(INDICES), RANK)
    grouped_lora_matmul(x, lora_a, slot_rows(same), whole, 2.0, add=False)
    bgmv_shrink(x, lora_a, vllms, same, 2.0)
    torch.testing.assert_close(whole, vllms, rtol=1e-5, atol=1e-5)
    assert slot_rows(torch.full((3,), -1)) == []  # the base model alone: nothing to compute
