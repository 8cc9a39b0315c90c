"""Image prompts on the V1 engine, on GPU hosts (on CPU an image model is a load error: the V1
environment there has no torchvision, engine_v1/process.py refuse_image_models_on_cpu).

Owns what vLLM 0.32 is given of a request's images: each image file the stub checked against the
model's limit (stub/images.py) decoded to RGB, in the order of the prompt's placeholders, as the
prompt's `multi_modal_data` (vLLM's own processor then expands each placeholder, as `vllm serve`
does for the same prompt and images); and that limit, read from the model's config. Decodes nothing
the stub did not check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from triton_vllm_multistep.interface import decode_image


def images_per_prompt(model_config: Any) -> int:
    """How many images vLLM 0.32 lets one prompt of this model hold (`limit_mm_per_prompt`; vLLM's
    own default where unset); 0 for a text-only model."""
    multimodal = getattr(model_config, "multimodal_config", None)
    if not model_config.is_multimodal_model or multimodal is None:
        return 0
    return int(multimodal.get_limit_per_prompt("image"))


def with_images(prompt: dict[str, Any], images: Sequence[bytes]) -> dict[str, Any]:
    """V1's prompt (token ids holding the model's image placeholders) with its images, in order."""
    if not images:
        return prompt
    return {**prompt, "multi_modal_data": {"image": [decode_image(data) for data in images]}}
