"""Stateless detokenization of streamed deltas, shared by the LLM model and `postprocessing`.

Owns the "text window" contract: the LLM model sends a few token ids (the new ones plus enough
preceding context) and the character range of the new text inside their decoding; any stateless
consumer decodes the window the same way and slices. Must not hold per-request state.

Why a window and not the single new token: SentencePiece-style tokenizers encode a word's
leading space in the *next* token ("▁word"), which decodes differently alone than in context,
and byte-level / byte-fallback tokenizers split one multi-byte character across tokens. vLLM's
engine already solved this (`detokenize_incrementally`, with prefix/read offsets and hold-back of
incomplete characters and of text that may still become a stop string); its text is the truth,
and the window lets a stateless model reproduce exactly that text.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens before the new ones that the window starts with; doubled until the delta is found
# (a 4-byte character split into byte tokens, a leading "▁", or stop-string hold-back).
INITIAL_LOOKBACK = 8
# vLLM's incremental detokenizer looks at most this many prompt tokens back (5 + 2 spare).
ENGINE_PROMPT_CONTEXT = 7


@dataclass(frozen=True)
class TextWindow:
    """Token ids, how many of them are context only, and the new text's [start, end) range in
    the text that replaying vLLM's incremental detokenizer over the rest produces."""

    ids: list[int]
    context: int
    start: int
    end: int


# vLLM's detokenizer module, run from its own source file (`vllm_detokenizer`): its one import, a
# type alias for annotations only, is given to it instead.
VLLM_DETOKENIZER_FILE = ("transformers_utils", "detokenizer_utils.py")
VLLM_DETOKENIZER_IMPORT = "from .tokenizer import AnyTokenizer\n"


@functools.cache
def vllm_detokenizer() -> types.ModuleType:
    """vLLM's `detokenizer_utils` module (the installed vLLM's file, unchanged but for its one import),
    without importing the `vllm` package: that imports torch and all of vLLM, 5-17 s and ~1 GB in
    a postprocessing stub that needs one pure-Python function (docs/architecture.md)."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vLLM is not installed: the detokenizer replays vLLM's own code")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*VLLM_DETOKENIZER_FILE)
    source = path.read_text(encoding="utf-8")
    if VLLM_DETOKENIZER_IMPORT not in source:
        raise ImportError(f"{path} is not vLLM 0.8.5's detokenizer module (its import changed): cannot replay it")
    module = types.ModuleType("triton_vllm_multistep.stub._vllm_detokenizer_utils")
    module.__file__ = str(path)
    code = compile(source.replace(VLLM_DETOKENIZER_IMPORT, "from typing import Any as AnyTokenizer\n"), path, "exec")
    exec(code, module.__dict__)  # vLLM's own installed source
    return module


def window_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[Sequence[int], int], str]:
    """Replay of vLLM's own `detokenize_incrementally` over ids[context:], ids[:context] as prompt.

    Replaying the engine's algorithm (not decoding the window in one go) matters: incremental
    decoding of invalid byte sequences differs from a one-shot decode of the same tokens.
    """
    detokenize_incrementally = vllm_detokenizer().detokenize_incrementally

    def replay(ids: Sequence[int], context: int) -> str:
        ids = list(ids)
        tokens: list[str] | None = None
        prefix_offset = read_offset = 0
        pieces = []
        for index in range(context, len(ids)):
            new_tokens, text, prefix_offset, read_offset = detokenize_incrementally(
                tokenizer,
                ids[: index + 1],
                tokens,
                prefix_offset,
                read_offset,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=True,
            )
            tokens = new_tokens if tokens is None else tokens + new_tokens
            pieces.append(text)
        return "".join(pieces)

    return replay


def text_window(
    all_ids: Sequence[int],
    prompt_len: int,
    new_tokens: int,
    delta_text: str,
    replay: Callable[[Sequence[int], int], str],
) -> TextWindow:
    """A window of `all_ids` (prompt + output so far) whose replay contains `delta_text`.

    `delta_text` is what the engine emitted with the last `new_tokens` tokens (possibly text held
    back from earlier ones). Once the window reaches back into the prompt, its replay starts from
    the very state the engine started from, so the search always ends.
    """
    if not delta_text:
        return TextWindow([], 0, 0, 0)
    lookback = INITIAL_LOOKBACK
    while True:
        first = len(all_ids) - new_tokens - lookback
        exact = first <= prompt_len
        if exact:  # start where the engine started: the prompt's tail as context
            first = max(0, prompt_len - ENGINE_PROMPT_CONTEXT)
            context = prompt_len - first
        else:
            context = lookback // 2
        ids = list(all_ids[first:])
        text = replay(ids, context)
        position = text.rfind(delta_text)
        if position >= 0:
            return TextWindow(ids, context, position, position + len(delta_text))
        if exact:
            raise ValueError("the engine's text is not what replaying its detokenizer gives")
        lookback *= 2


def slice_window(ids: Sequence[int], offsets: Sequence[int], replay: Callable[[Sequence[int], int], str]) -> str:
    """The consumer side: replay the window and keep the announced range."""
    context, start, end = (int(x) for x in offsets)
    if not ids or end <= start:
        return ""
    text = replay(ids, context)
    if not 0 <= start <= end <= len(text):
        raise ValueError(f"text range [{start}, {end}) is outside the window's {len(text)} characters")
    return text[start:end]
