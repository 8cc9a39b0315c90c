"""Image prompts for the engine loop: vLLM's own processing of a prompt with images runs on a thread of
its own, and multimodal models that multi-step cannot advance are refused at load.

Owns turning (prompt token ids, encoded images) into vLLM 0.8.5's processed inputs: each image
file decoded to RGB (the stub has checked it against the model's limits and decoded it once
already, stub/images.py: what crosses to the engine is the file), then vLLM's `InputPreprocessor`
(the model's HF processor, its placeholder expansion and vLLM's processing cache); and the list of
model kinds multi-step cannot run exactly. Must not drive the engine (engine/loop.py admits what is
processed) and never reads the request's base64 (the stub's).

Why not in the engine's step: vLLM's `LLMEngine.add_request` runs the model's image processor
(resize, normalise, patching) inline, on the thread that steps the engine, so every running stream
would wait for it. Here it runs before admission; what it still holds the GIL for is in
docs/multimodal.md. A tokenizer group of its own: the engine thread detokenizes with the engine's,
and a fast tokenizer is not safe to share across threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm.config import ModelConfig
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import TokensPrompt

from triton_vllm_multistep.interface import decode_image

logger = logging.getLogger(__name__)

# (request id, vLLM's processed inputs) once processed; (request id, error message) when not.
Processed = Callable[[str, Any], None]
Refused = Callable[[str, str], None]

_MROPE_REASON = (
    "{model} uses M-RoPE (multimodal rotary positions, e.g. Qwen2-VL, Qwen2.5-VL): its positions are 3 rows "
    "per token, and vLLM 0.8.5's multi-step advance_step (GPU, ops.advance_step_flashattn) and this "
    "backend's CPU runner move a 1-D position per token between the steps of a window, so every decode "
    "step after the first would run at wrong positions"
)
_ENCODER_DECODER_REASON = (
    "{model} is an encoder-decoder model (e.g. Mllama, Llama 3.2 Vision, whose decode steps attend to the "
    "image through cross-attention): vLLM 0.8.5's multi-step runners advance decoder-only inputs, and "
    "its encoder-decoder runner is not one of them"
)
_FIX = "set num_scheduler_steps to 1 for this model"


def multi_step_refusal(model_config: ModelConfig, steps: int) -> str | None:
    """Why `steps` > 1 cannot serve this model exactly (None: it can), with the fix."""
    if steps <= 1:
        return None
    name = model_config.model
    if model_config.runner_type == "pooling":
        # model.json without `task` (vLLM's "auto" found an embedding model): the backend's default
        # num_scheduler_steps came with it; with "task": "embed" no default is set (settings/engine_json.py).
        return (
            f"{name} is an embedding model (vLLM's task {model_config.task!r}), which has no decode steps: "
            f"num_scheduler_steps={steps} (the backend's default unless model.json sets it) cannot apply; set "
            '"task": "embed" in model.json (and no num_scheduler_steps)'
        )
    if model_config.uses_mrope:
        reason = _MROPE_REASON.format(model=name)
    elif model_config.is_encoder_decoder:
        reason = _ENCODER_DECODER_REASON.format(model=name)
    else:
        return None
    return f"num_scheduler_steps={steps} cannot serve this model: {reason}; {_FIX}"


PREFIX_CACHING_REFUSAL = (
    "enable_prefix_caching cannot serve {model}, a multimodal model: vLLM 0.8.5's V0 prefix cache keys "
    "blocks by token ids only (vllm/sequence.py Sequence.extra_hash), so two prompts with different images "
    "would share the cached blocks of their image placeholders; vLLM itself turns it off for such models "
    "(engine/arg_utils.py), which would leave the setting silently unapplied: remove enable_prefix_caching"
)


def prefix_caching_refusal(model_config: ModelConfig) -> str | None:
    """Why prefix caching cannot be on for this model (None: it can)."""
    if model_config.is_multimodal_model:
        return PREFIX_CACHING_REFUSAL.format(model=model_config.model)
    return None


def images_per_prompt(model_config: ModelConfig) -> int:
    """How many images vLLM lets one prompt hold (`limit_mm_per_prompt`, 1 unless set); 0 for text-only models."""
    if not model_config.is_multimodal_model or model_config.multimodal_config is None:
        return 0
    return int(model_config.multimodal_config.get_limit_per_prompt("image"))


def image_prompt(prompt_token_ids: list[int], images: Sequence[Any]) -> TokensPrompt:
    """vLLM's prompt for token ids holding the model's image placeholders, with the images in order."""
    return TokensPrompt(prompt_token_ids=prompt_token_ids, multi_modal_data={"image": list(images)})


class ImagePromptProcessor:
    """Processes image prompts for the engine loop on a thread of its own, in order."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._preprocessor: Any = None  # built by its thread before its first request
        self._work: queue.SimpleQueue[tuple[str, list[int], Sequence[bytes], Any, Processed, Refused] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="vllm-image-prompts", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        images: Sequence[bytes],
        lora_request: Any,
        processed: Processed,
        refused: Refused,
    ) -> None:
        """Queue a prompt holding the model's image placeholders with its encoded `images`, in order."""
        self._work.put((request_id, prompt_token_ids, images, lora_request, processed, refused))

    def stop(self) -> None:
        self._work.put(None)

    def _build_preprocessor(self) -> Any:
        from vllm.inputs.preprocess import InputPreprocessor

        engine = self._engine
        tokenizer = engine._init_tokenizer() if engine.tokenizer is not None else None
        return InputPreprocessor(engine.model_config, tokenizer, engine.input_preprocessor.mm_registry)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            request_id, prompt_token_ids, images, lora_request, processed, refused = item
            try:
                prompt = image_prompt(prompt_token_ids, [decode_image(data) for data in images])
                if self._preprocessor is None:
                    self._preprocessor = self._build_preprocessor()
                inputs = self._preprocessor.preprocess(prompt, lora_request=lora_request)
            except Exception as error:
                # vLLM's own words (a prompt without the model's placeholder, too many images, ...).
                count = len(images)
                logger.info("the image prompt of %s (%d image(s)) cannot be processed: %s", request_id, count, error)
                refused(request_id, f"the image prompt cannot be processed: {type(error).__name__}: {error}")
            else:
                try:
                    processed(request_id, inputs)
                except Exception as error:  # the request must still end, and this thread go on
                    logger.exception("handing over the processed image prompt of %s failed", request_id)
                    refused(request_id, f"internal error admitting the image prompt: {error}")
