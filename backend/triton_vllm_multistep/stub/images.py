"""The `image` input: base64-encoded images checked against the model's limits, decoded once to check.

Owns reading one request's `image` tensor as Triton's vLLM backend (r24.12+) reads it (each element
a base64-encoded image, opened with PIL and converted to RGB, in order; the encoding and
encode_image are interface.py's) and refusing what the model cannot take; must not run the
model's image processor (engine/multimodal.py hands the images to vLLM's) and runs on the thread
that decodes requests, never the engine's. What goes on to the engine is each image's file (the
base64 decoded), which the engine decodes again (interface.decode_image): no PIL image
crosses to an engine process.

The limits bound what one request can make the server hold: the encoded bytes of each image, its
pixels (read from the image's header before any pixel is decoded, so a small file that would expand
to a huge bitmap is refused without expanding it), and the number of images (vLLM's
`limit_mm_per_prompt`, checked here so that it fails with the input's name before the engine).
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from triton_vllm_multistep.interface import IMAGE_INPUT


class ImageError(ValueError):
    """An `image` element the model cannot take; the message names the input and the element."""


def _element_bytes(item: Any) -> bytes:
    if isinstance(item, str):
        return item.encode("ascii", errors="replace")
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    raise ImageError(f"input '{IMAGE_INPUT}' must be TYPE_STRING (BYTES) elements, got {type(item).__name__}")


def read_image(item: Any, index: int, max_bytes: int, max_pixels: int) -> bytes:
    """One element of the `image` tensor (element `index`, counted from 0) → the image's file, once its
    pixels decode to RGB within the limits."""
    from PIL import Image, UnidentifiedImageError

    where = f"input '{IMAGE_INPUT}' element {index}"
    text = _element_bytes(item)
    if len(text) > max_bytes:
        raise ImageError(f"{where} is {len(text)} bytes, over this model's max_image_bytes of {max_bytes}")
    if text.startswith(b"data:") and b";base64," in text[:256]:
        text = text.split(b";base64,", 1)[1]  # a data URL, as OpenAI-style clients send images
    try:
        # Line breaks and spaces are dropped first (`base64` wraps its output at 76 columns).
        data = base64.b64decode(b"".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"{where} is not base64: {error}") from None
    if not data:
        raise ImageError(f"{where} is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
        raise ImageError(f"{where} is not an image PIL can read ({type(error).__name__}: {error})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"{where} is {width}x{height} = {width * height} pixels, over this model's max_image_pixels of {max_pixels}"
        )
    if width == 0 or height == 0:
        raise ImageError(f"{where} has no pixels ({width}x{height})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.convert("RGB")  # decodes the pixels, as the engine will
    except Exception as error:  # truncated or corrupt data, an unsupported mode
        raise ImageError(f"{where} cannot be decoded ({type(error).__name__}: {error})") from None
    return data


def read_images(
    array: np.ndarray, images_per_prompt: int, model_name: str, max_bytes: int, max_pixels: int
) -> tuple[bytes, ...]:
    """The request's `image` tensor → its checked image files, in order (none for an empty tensor).

    `images_per_prompt` is the model's limit (0: a text-only model, which takes none).
    """
    items: Sequence[Any] = array.reshape(-1).tolist()
    if not items:
        return ()
    if images_per_prompt == 0:
        # vLLM's words for it (what Triton's vLLM backend answers), naming the input.
        raise ImageError(f"input '{IMAGE_INPUT}': {model_name} is not a multimodal model")
    if len(items) > images_per_prompt:
        raise ImageError(
            f"input '{IMAGE_INPUT}' holds {len(items)} images, more than this model's limit of {images_per_prompt} "
            "per prompt (vLLM's limit_mm_per_prompt in model.json)"
        )
    return tuple(read_image(item, index, max_bytes, max_pixels) for index, item in enumerate(items))
