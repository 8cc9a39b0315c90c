"""Where a V0 engine step's time goes, and the forward-only throughput ceiling, for benchmarks.

Owns the phase timer, attaching it to one engine's own objects, and the ceiling measurement;
must not change what an engine computes, and must not be attached outside benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.sequence import SequenceData, SequenceGroupMetadata

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "pythonize", "output_processing")


class StepTimer:
    """Accumulates wall-clock seconds per phase across engine steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += clock() - start

        return wrapper


def driver_runner(engine: Any) -> Any:
    """The model runner of the engine's in-process (rank 0) worker."""
    return engine.model_executor.driver_worker.worker.model_runner


def attach(engine: Any) -> StepTimer:
    """Time the phases of `engine`'s steps by wrapping methods of its own instances.

    Works for vLLM's CPU engine and for the CPU multi-step engine alike. With steps=1, vLLM's
    sampler pythonizes while sampling, so that time is counted under "sample". CPU only: on CUDA
    wall-clock time around a module call measures kernel launches, and CUDA graphs skip the call.
    """
    device = engine.device_config.device
    if getattr(device, "type", None) != "cpu":
        raise RuntimeError(f"step_timing times CPU engines only (this engine runs on {device})")
    timer = StepTimer()
    scheduler = engine.scheduler[0]
    scheduler.schedule = timer.timed("schedule", scheduler.schedule)
    engine._process_model_outputs = timer.timed("output_processing", engine._process_model_outputs)
    if hasattr(engine, "_process_intermediate_step"):  # the CPU multi-step engine's lean path
        engine._process_intermediate_step = timer.timed("output_processing", engine._process_intermediate_step)
    worker = engine.model_executor.driver_worker.worker
    worker.prepare_input = timer.timed("prepare_inputs", worker.prepare_input)
    runner = worker.model_runner
    runner.model.forward = timer.timed("forward", runner.model.forward)
    runner.model.compute_logits = timer.timed("forward", runner.model.compute_logits)
    runner.sampler.forward = timer.timed("sample", runner.sampler.forward)
    if hasattr(runner, "pythonize"):
        runner.pythonize = timer.timed("pythonize", runner.pythonize)
    return timer


def _synthetic_decode_batch(
    batch_size: int, context_len: int, block_size: int, num_blocks: int
) -> list[SequenceGroupMetadata]:
    blocks_per_seq = -(-(context_len + 1) // block_size)
    if batch_size * blocks_per_seq > num_blocks:
        raise ValueError(
            f"the KV cache has {num_blocks} blocks; batch {batch_size} x context {context_len} "
            f"needs {batch_size * blocks_per_seq}"
        )
    groups = []
    for i in range(batch_size):
        tokens = [(i * 7 + j) % 1000 + 3 for j in range(context_len)]
        data = SequenceData.from_seqs(tokens[:1], tokens[1:])
        data.update_num_computed_tokens(context_len - 1)
        first = i * blocks_per_seq
        groups.append(
            SequenceGroupMetadata(
                request_id=f"ceiling-{i}",
                is_prompt=False,
                seq_data={i: data},
                sampling_params=SamplingParams(temperature=0.0),
                block_tables={i: list(range(first, first + blocks_per_seq))},
            )
        )
    return groups


def forward_only_ceiling(
    engine: Any, batch_size: int, *, context_len: int = 64, iterations: int = 32, warmup: int = 3
) -> float:
    """Decode tokens per second of `batch_size` sequences' forward passes run back to back.

    One decode input is prepared once and its forward pass (model and logits, no sampling, no
    scheduling, no output processing) repeated: the most any engine loop could reach for this
    batch. Writes into the KV cache's first blocks, so run it only while the engine is idle.
    """
    runner = driver_runner(engine)
    num_blocks = engine.cache_config.num_gpu_blocks
    metadata = _synthetic_decode_batch(batch_size, context_len, runner.block_size, num_blocks)
    model_input = runner.prepare_model_input(metadata)

    def forward() -> None:
        with set_forward_context(model_input.attn_metadata, runner.vllm_config, 0):
            hidden = runner.model(
                input_ids=model_input.input_tokens,
                positions=model_input.input_positions,
                intermediate_tensors=None,
            )
        runner.model.compute_logits(hidden, model_input.sampling_metadata)

    with torch.inference_mode():
        for _ in range(warmup):
            forward()
        start = time.perf_counter()
        for _ in range(iterations):
            forward()
        elapsed = time.perf_counter() - start
    return batch_size * iterations / elapsed
