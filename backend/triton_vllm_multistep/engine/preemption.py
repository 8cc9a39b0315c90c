"""vLLM V0's preemption by recompute made exact for seeded requests.

Owns one correction to vLLM 0.8.5's sampling metadata, for every V0 engine of this backend (CPU
and GPU, multi-step or not): a preempted request comes back through a prefill of its prompt and
output so far, and vLLM's `_prepare_seq_groups` seeds a new generator from the request's `seed` for
every prefill, so the rest of a seeded answer restarted its random stream and differed from the
answer the request gets unpreempted (measured: an urgent request's priority preemption changed a
seeded victim's tokens). The generator the request sampled with until then is kept instead: its
state is exactly after the last token the request kept, so the recomputed prefill samples as the
next decode step would have. Must not change anything for a first prefill.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def keep_seeded_generators_across_recompute() -> None:
    """Install the correction (idempotent; vLLM's module function is replaced once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor import sampling_metadata

    prepare = sampling_metadata._prepare_seq_groups

    def prepare_keeping_generators(
        seq_group_metadata_list: list[Any], seq_lens: Any, query_lens: Any, device: str, generators: Any, cache: Any
    ) -> Any:
        kept = {}
        if generators:
            for index, metadata in enumerate(seq_group_metadata_list):
                params = metadata.sampling_params
                if (
                    metadata.is_prompt
                    and params is not None
                    and params.seed is not None
                    and metadata.request_id in generators
                    and any(data.get_output_len() for data in metadata.seq_data.values())  # a recompute
                ):
                    kept[index] = generators[metadata.request_id]
        prepared = prepare(seq_group_metadata_list, seq_lens, query_lens, device, generators, cache)
        for index, generator in kept.items():
            generators[seq_group_metadata_list[index].request_id] = generator
            prepared[0][index].generator = generator
        return prepared

    sampling_metadata._prepare_seq_groups = prepare_keeping_generators
    _INSTALLED = True
