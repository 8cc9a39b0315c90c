"""Detokenization windows: what the LLM model sends lets a stateless consumer rebuild the engine's
exact text delta, for both demo tokenizers (byte-level BPE; metaspace with byte fallback).

The engine's deltas are produced here the way vLLM's V0 detokenizer produces them (its own
`detokenize_incrementally`, one token at a time from the prompt on); the windows are then cut
the way the LLM model cuts them and replayed the way postprocessing replays them. The ensemble
through a real server is in tests/e2e/test_ensemble.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer
from vllm.transformers_utils.detokenizer_utils import detokenize_incrementally

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.stub import detokenization

PROMPT = "Streams of text:"
# Spaces at token boundaries, multi-byte characters split across byte tokens, words the
# tokenizer has never seen.
GENERATED = " the cat sat on the mat, 你好 世界 🙂🎉 naïve façade — zebras' quixotic jazz. " * 2


@pytest.fixture(scope="module", params=["tiny-llama-bpe", "tiny-llama-spm"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return AutoTokenizer.from_pretrained(demo_models.build(request.param))


def engine_deltas(tokenizer: Any, prompt_ids: list[int], output_ids: list[int]) -> list[str]:
    """The text vLLM's V0 detokenizer emits with each output token."""
    ids = list(prompt_ids)
    tokens: list[str] | None = None
    prefix_offset = read_offset = 0
    deltas = []
    for token in output_ids:
        ids.append(token)
        new_tokens, text, prefix_offset, read_offset = detokenize_incrementally(
            tokenizer, ids, tokens, prefix_offset, read_offset, skip_special_tokens=True
        )
        tokens = new_tokens if tokens is None else tokens + new_tokens
        deltas.append(text)
    return deltas


@pytest.mark.parametrize("tokens_per_delta", [1, 3, 8])  # per step; a window's worth at once
def test_windows_rebuild_every_delta_exactly(tokenizer: Any, tokens_per_delta: int) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    output_ids = tokenizer.encode(GENERATED, add_special_tokens=False)
    per_token = engine_deltas(tokenizer, prompt_ids, output_ids)
    assert "".join(per_token).strip() == GENERATED.strip()  # the reference is right to begin with
    replay = detokenization.window_decoder(tokenizer)  # one on each side, as in the server
    consumer = detokenization.window_decoder(tokenizer)
    rebuilt = []
    short_windows = 0
    for start in range(0, len(output_ids), tokens_per_delta):
        end = min(start + tokens_per_delta, len(output_ids))
        delta = "".join(per_token[start:end])
        window = detokenization.text_window(prompt_ids + output_ids[:end], len(prompt_ids), end - start, delta, replay)
        text = detokenization.slice_window(window.ids, [window.context, window.start, window.end], consumer)
        assert text == delta, (start, end)
        rebuilt.append(text)
        short_windows += len(window.ids) < len(prompt_ids) + end
    assert "".join(rebuilt) == "".join(per_token)
    assert short_windows > 0  # windows are not just the whole sequence again


def test_an_empty_delta_needs_no_window(tokenizer: Any) -> None:
    window = detokenization.text_window([1, 2, 3], 2, 1, "", detokenization.window_decoder(tokenizer))
    assert window == detokenization.TextWindow([], 0, 0, 0)
    assert detokenization.slice_window([], [0, 0, 0], detokenization.window_decoder(tokenizer)) == ""


def test_a_range_outside_the_window_is_refused(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    with pytest.raises(ValueError, match="outside the window"):
        detokenization.slice_window(ids, [0, 0, 10_000], detokenization.window_decoder(tokenizer))


def test_text_the_tokens_cannot_give_is_an_error_not_a_loop(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    with pytest.raises(ValueError, match="not what replaying"):
        detokenization.text_window(ids, 1, 1, "text that is not there", detokenization.window_decoder(tokenizer))


def test_the_replay_runs_vllms_own_detokenizer_without_importing_vllm(tokenizer: Any) -> None:
    """window_decoder runs the installed vLLM's detokenizer_utils.py, loaded without the `vllm` package
    (a postprocessing stub would otherwise import torch and all of vLLM): the same file, the same
    results token by token as vLLM's imported function."""
    from vllm.transformers_utils import detokenizer_utils

    standalone = detokenization.vllm_detokenizer()
    assert standalone.__file__ == detokenizer_utils.__file__
    assert standalone.detokenize_incrementally is not detokenize_incrementally
    ids = tokenizer.encode(PROMPT + GENERATED)
    results = []
    for function in (detokenize_incrementally, standalone.detokenize_incrementally):
        tokens: list[str] | None = None
        prefix_offset = read_offset = 0
        steps = []
        for end in range(1, len(ids) + 1):
            new_tokens, text, prefix_offset, read_offset = function(
                tokenizer, ids[:end], tokens, prefix_offset, read_offset, skip_special_tokens=False
            )
            tokens = new_tokens if tokens is None else tokens + new_tokens
            steps.append((tuple(new_tokens), text, prefix_offset, read_offset))
        results.append(steps)
    assert results[0] == results[1]
