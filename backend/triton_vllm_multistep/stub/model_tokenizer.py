"""A multi-step model's tokenizer for the stub (execute()'s prompts, the detokenization windows).

Owns loading it as vLLM 0.8.5's `get_tokenizer` does (the same files, the same keyword arguments:
vllm/transformers_utils/tokenizer.py) and where it can, without vLLM or torch: with the engine in a
process of its own, the stub runs no model, and importing vLLM to read a tokenizer cost the stub
~9.6 CPU-s and ~870 MB resident against ~0.9 CPU-s and ~80-140 MB for transformers told that
torch is absent (measured on the demo tokenizers). Tokenizers only vLLM loads (its `mistral` and
`custom` modes, GGUF files, ModelScope, remote code) go through vLLM's own function.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# tokenizer_mode values transformers alone does not load (vLLM's own tokenizer classes).
VLLM_TOKENIZER_MODES = ("mistral", "custom")


@dataclass(frozen=True)
class TokenizerSource:
    """What vLLM's engine loads its tokenizer from: EngineArgs' tokenizer fields, defaults filled as
    vLLM 0.8.5's EngineArgs fills them (`tokenizer` empty: the model's)."""

    name: str
    mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None

    @classmethod
    def of_engine_args(cls, engine_args: Mapping[str, Any]) -> TokenizerSource:
        return cls(
            str(engine_args.get("tokenizer") or engine_args.get("model") or ""),
            str(engine_args.get("tokenizer_mode") or "auto"),
            bool(engine_args.get("trust_remote_code")),
            engine_args.get("tokenizer_revision"),
        )

    @property
    def needs_vllm(self) -> bool:
        """Whether only vLLM's get_tokenizer loads it as the engine does."""
        return (
            self.mode in VLLM_TOKENIZER_MODES
            or self.trust_remote_code  # its code may need torch, which transformers is told is absent
            or self.name.endswith(".gguf")
            or os.environ.get("VLLM_USE_MODELSCOPE", "").lower() == "true"  # vLLM's reading of it
        )


def load_tokenizer(source: TokenizerSource, with_vllm: bool = False) -> Any:
    """The tokenizer vLLM's engine uses for `source`; through vLLM's get_tokenizer when `with_vllm`
    (the engine runs in this process: vLLM is loaded anyway) or when only vLLM can load it."""
    if with_vllm or source.needs_vllm:
        from vllm.transformers_utils.tokenizer import get_tokenizer

        return get_tokenizer(
            source.name,
            tokenizer_mode=source.mode,
            trust_remote_code=source.trust_remote_code,
            revision=source.revision,
        )
    _import_transformers_without_torch()
    from transformers import AutoTokenizer

    # vLLM's get_tokenizer for tokenizer_mode auto/slow: these keyword arguments and no others.
    options: dict[str, Any] = {"truncation_side": "left"}
    if source.mode == "slow":
        options["use_fast"] = False
    return AutoTokenizer.from_pretrained(source.name, trust_remote_code=False, revision=source.revision, **options)


def _import_transformers_without_torch() -> None:
    """transformers reads USE_TORCH once, at its import: torch absent, its tokenizers import no torch
    (transformers 4.51's chat_template_utils imports torch whenever it is installed). The variable is
    restored at once: nothing this process starts later inherits it. A transformers already imported
    (a demo model built in this stub) stays as it is."""
    if "transformers" in sys.modules:
        return
    before = os.environ.get("USE_TORCH")
    os.environ["USE_TORCH"] = "0"
    try:
        import transformers.utils.import_utils  # noqa: F401
    finally:
        if before is None:
            del os.environ["USE_TORCH"]
        else:
            os.environ["USE_TORCH"] = before
