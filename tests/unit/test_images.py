"""The `image` input's decoding and limits (stub/images.py through stub/codec.py), with real PIL images;
what the stub hands on (each image's file) decodes in the engine (interface.decode_image) to
the image the client sent."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

from triton_vllm_multistep.engine_v1 import images as v1_images
from triton_vllm_multistep.interface import decode_image
from triton_vllm_multistep.settings import Limits
from triton_vllm_multistep.stub import codec

MODEL = codec.ModelLimits(vocab_size=100, max_model_len=64, model_name="demo/llava", images_per_prompt=2)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue())


def request(*images: bytes | str, model: codec.ModelLimits = MODEL) -> codec.GenerationRequest:
    inputs = {
        "text_input": np.array([b"<image> what is it?"], dtype=np.object_),
        "image": np.array(list(images), dtype=np.object_),
    }
    return codec.decode_request(inputs, None, model, encode=lambda s: [1, 2, 3], decode=lambda ids: "x")


def refused(*images: bytes | str, model: codec.ModelLimits = MODEL) -> str:
    with pytest.raises(codec.RequestError) as raised:
        request(*images, model=model)
    return str(raised.value)


def test_images_are_decoded_to_rgb_in_order_whatever_their_format_and_mode() -> None:
    red = Image.new("RGB", (7, 5), (255, 0, 0))
    grey = Image.new("L", (3, 4), 128)
    generation = request(encoded(red), encoded(grey, "JPEG"))
    first, second = (decode_image(data) for data in generation.images)
    assert (first.mode, first.size, first.getpixel((0, 0))) == ("RGB", (7, 5), (255, 0, 0))
    assert (second.mode, second.size) == ("RGB", (3, 4))
    assert generation.prompt_token_ids == [1, 2, 3] and generation.prompt_tokens == 3


def test_wrapped_base64_and_data_urls_are_read_as_the_same_image() -> None:
    image = Image.new("RGB", (40, 30), (1, 2, 3))
    plain = encoded(image)
    wrapped = b"\n".join(plain[i : i + 76] for i in range(0, len(plain), 76)) + b"\n"  # `base64` output
    data_url = b"data:image/png;base64," + plain
    for form in (plain, wrapped, data_url, plain.decode()):
        (decoded,) = (decode_image(data) for data in request(form).images)
        assert decoded.tobytes() == image.tobytes()


def test_no_image_elements_is_a_text_prompt() -> None:
    assert request().images == ()


def test_bad_images_are_refused_naming_the_input_and_the_element() -> None:
    good = encoded(Image.new("RGB", (2, 2)))
    assert refused(good, b"not base64!").startswith("input 'image' element 1 is not base64")
    assert "input 'image' element 0 is not an image PIL can read" in refused(base64.b64encode(b"plain text"))
    noisy = Image.fromarray(np.random.default_rng(2).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    whole = base64.b64decode(encoded(noisy))
    truncated = base64.b64encode(whole[: len(whole) * 2 // 3])  # a readable header, two thirds of the pixels
    assert "input 'image' element 0 cannot be decoded" in refused(truncated)
    assert "input 'image' element 0 is empty" in refused(b"")


def test_more_images_than_the_model_takes_per_prompt_are_refused_naming_its_limit() -> None:
    good = encoded(Image.new("RGB", (2, 2)))
    message = refused(good, good, good)
    assert "input 'image' holds 3 images, more than this model's limit of 2 per prompt" in message
    assert "limit_mm_per_prompt" in message


def test_a_text_only_model_refuses_images_in_vllms_words() -> None:
    text_only = codec.ModelLimits(vocab_size=100, max_model_len=64, model_name="demo/tiny")
    assert refused(encoded(Image.new("RGB", (2, 2))), model=text_only) == (
        "input 'image': demo/tiny is not a multimodal model"
    )


def test_images_over_the_byte_or_pixel_limits_are_refused_before_their_pixels_are_decoded() -> None:
    small = codec.ModelLimits(
        vocab_size=100,
        max_model_len=64,
        images_per_prompt=1,
        limits=Limits(max_image_bytes=1000, max_image_pixels=100 * 100),
    )
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    assert "input 'image' element 0 is" in (message := refused(encoded(noisy), model=small))
    assert "over this model's max_image_bytes of 1000" in message
    # A 1-colour 5000x5000 PNG is a few kB but 25 M pixels: refused from its header alone.
    huge = encoded(Image.new("1", (5000, 5000)))
    assert len(huge) < 10_000
    message = refused(huge, model=codec.ModelLimits(vocab_size=100, max_model_len=64, images_per_prompt=1))
    assert message == (
        "input 'image' element 0 is 5000x5000 = 25000000 pixels, over this model's max_image_pixels of 16777216"
    )


def test_images_do_not_count_against_max_request_bytes() -> None:
    model = codec.ModelLimits(
        vocab_size=100, max_model_len=64, images_per_prompt=1, limits=Limits(max_request_bytes=100)
    )
    noisy = Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    assert len(request(encoded(noisy), model=model).images) == 1


def test_a_v1_prompt_carries_the_stubs_image_files_decoded_in_order() -> None:
    """engine_v1/images.py (GPU hosts): what vLLM 0.32 is given for a request's checked image files."""
    red = Image.new("RGB", (7, 5), (255, 0, 0))
    grey = Image.new("L", (3, 4), 128)
    generation = request(encoded(red), encoded(grey, "JPEG"))
    prompt = {"prompt_token_ids": generation.prompt_token_ids}
    given = v1_images.with_images(prompt, generation.images)
    assert given["prompt_token_ids"] == [1, 2, 3]
    first, second = given["multi_modal_data"]["image"]
    assert (first.mode, first.size, first.tobytes()) == ("RGB", (7, 5), red.tobytes())
    assert (second.mode, second.size) == ("RGB", (3, 4))
    assert v1_images.with_images(prompt, ()) is prompt  # a text prompt is left as it is


@dataclass
class _MultiModalConfig:  # vLLM 0.32's MultiModalConfig: the one method read (no model needed)
    limits: dict[str, int]

    def get_limit_per_prompt(self, modality: str) -> int:
        return self.limits.get(modality, 999)  # vLLM 0.32's default for an unset modality


@dataclass
class _ModelConfig:
    is_multimodal_model: bool
    multimodal_config: _MultiModalConfig | None


def test_a_v1_models_image_limit_is_vllms_and_a_text_model_takes_none() -> None:
    assert v1_images.images_per_prompt(_ModelConfig(True, _MultiModalConfig({"image": 2}))) == 2
    assert v1_images.images_per_prompt(_ModelConfig(True, _MultiModalConfig({}))) == 999
    assert v1_images.images_per_prompt(_ModelConfig(False, None)) == 0
