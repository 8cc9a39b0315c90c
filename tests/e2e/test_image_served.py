"""Image input through the real server, as users of Triton's vLLM backend send it: the `image` input
(base64 images, in order) beside a prompt holding the model's `<image>` placeholders.

The tiny LLaVA demo model (demo/tiny_llava.py) served at num_scheduler_steps 8 (as `vllm_model`,
behind the shipped ensemble) and 1: the image changes the answer, the same image gives the same
answer, steps 8 == steps 1 == transformers' LLaVA, streamed == whole; images and text-only requests
mixed in one concurrent batch each equal their solo runs; the prompt is counted with its image
tokens (num_input_tokens, vllm:prompt_tokens_total); the ensemble passes `image` on; bad images fail
alone, naming `image`; an M-RoPE model (Qwen2-VL) fails its load with multi-step, naming why;
the OpenAI server (`--openai-port`) stops with the server. Owns the served image checks; must not assert on timings.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from PIL import Image
from private_servers import copy_pipeline_stages, metric, model_ready, scrape
from triton_clients import StreamResult, grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.checks import image_prompts as multimodal
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import tiny_llava
from triton_vllm_multistep.host import openai_process
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, free_ports, start_server

SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "model_repository" / "vllm_model"
STEPS8, STEPS1, MROPE = "vllm_model", "llava_steps1", "qwen2_vl"
LLAVA = f"demo://{tiny_llava.NAME}"
ENGINE = {"model": LLAVA, "max_model_len": 512, "limit_mm_per_prompt": {"image": 2}}
# Small limits, so that the refusals are cheap to provoke.
LIMITS = {"max_image_pixels": str(256 * 256), "max_image_bytes": str(200_000)}
MAX_TOKENS = 16
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
RED, NOISE = multimodal.solid_image(), multimodal.noise_image()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return demo_models.build(tiny_llava.NAME)


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("image-served")
    repository = root / "repository"
    copy_model(SHIPPED_MODEL, repository / STEPS8, ENGINE, LIMITS)
    copy_model(SHIPPED_MODEL, repository / STEPS1, {**ENGINE, "num_scheduler_steps": 1}, LIMITS)
    copy_pipeline_stages(repository, tokenizer=LLAVA)
    mrope_dir = multimodal.write_mrope_model(root / "qwen2-vl", tokenizer_from=model_dir)
    copy_model(SHIPPED_MODEL, repository / MROPE, {"model": str(mrope_dir), "max_model_len": 256})
    server = start_server(
        repository,
        root / "tritonserver.log",
        f"--openai-port={free_ports(1)[0]}",
        "--model-control-mode=explicit",
        *(f"--load-model={name}" for name in (STEPS8, "preprocessing", "postprocessing", "ensemble")),
    )
    try:
        server.wait_ready(timeout=600)
        server.wait_openai_ready()  # it serves the models loaded at READY: vllm_model
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.load_model(STEPS1)
        yield server
    finally:
        server.stop()


def _image_input(images: list[Image.Image | bytes]) -> grpcclient.InferInput:
    encoded = [item if isinstance(item, bytes) else multimodal.encode_image(item) for item in images]
    tensor = grpcclient.InferInput("image", [len(encoded)], "BYTES")
    tensor.set_data_from_numpy(np.array(encoded, dtype=np.object_))
    return tensor


def _generate(
    server: ServerProcess,
    model: str,
    prompt: str,
    images: list[Image.Image | bytes],
    stream: bool = True,
    sampling: dict | None = None,
    **flags: bool,
) -> StreamResult:
    inputs = make_inputs(grpcclient, prompt=prompt, sampling=sampling or SAMPLING, stream=stream, **flags)
    if images:
        inputs.append(_image_input(images))
    if model != "ensemble":
        return grpc_generate(server.grpc_url, model, inputs=inputs, timeout=300)
    return grpc_generate(server.grpc_url, model, inputs=inputs, timeout=300, outputs=["text_output"])


def _ok(result: StreamResult) -> StreamResult:
    assert result.error is None and result.finals == 1, result.error
    return result


def test_image_answers_at_steps_8_equal_steps_1_streamed_whole_and_transformers(
    image_server: ServerProcess, model_dir: Path
) -> None:
    cases = {
        "red": (multimodal.IMAGE_PROMPT, [RED]),
        "noise": (multimodal.IMAGE_PROMPT, [NOISE]),
        "two": (multimodal.TWO_IMAGE_PROMPT, [RED, NOISE]),
    }
    answers = {}
    for name, (prompt, images) in cases.items():
        streamed = _ok(_generate(image_server, STEPS8, prompt, images))
        whole = _ok(_generate(image_server, STEPS8, prompt, images, stream=False, exclude_input_in_output=True))
        one = _ok(_generate(image_server, STEPS1, prompt, images))
        assert streamed.token_ids() == whole.token_ids() == one.token_ids(), name
        assert all(len(r["output_ids"]) == 1 for r in streamed.data_responses)  # one response per step
        assert streamed.text() == whole.text()
        _, reference = multimodal.transformers_greedy(model_dir, prompt, images, MAX_TOKENS)
        assert streamed.token_ids() == reference, name
        answers[name] = streamed.token_ids()
    assert len({tuple(tokens) for tokens in answers.values()}) == 3  # the image changes the answer
    again = _ok(_generate(image_server, STEPS8, multimodal.IMAGE_PROMPT, [multimodal.solid_image()]))
    assert again.token_ids() == answers["red"]  # the same image, the same answer
    jpeg = _ok(_generate(image_server, STEPS8, multimodal.IMAGE_PROMPT, [multimodal.encode_image(RED, "JPEG")]))
    assert jpeg.token_ids() == answers["red"]  # a solid colour survives JPEG exactly


def test_images_and_text_mixed_in_one_concurrent_batch_each_equal_their_solo_run(
    image_server: ServerProcess,
) -> None:
    cases = [
        (multimodal.IMAGE_PROMPT, [RED]),
        (multimodal.IMAGE_PROMPT, [NOISE]),
        (multimodal.TWO_IMAGE_PROMPT, [NOISE, RED]),
        (multimodal.TEXT_PROMPT, []),
    ]
    solo = [_ok(_generate(image_server, STEPS8, prompt, images)).token_ids() for prompt, images in cases]
    batch = cases * 3
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda case: _generate(image_server, STEPS8, *case), batch))
    for index, result in enumerate(results):
        assert _ok(result).token_ids() == solo[index % len(cases)], batch[index][0]


def test_the_prompt_is_counted_with_its_image_tokens_as_vllm_counts_it(image_server: ServerProcess) -> None:
    from transformers import AutoTokenizer

    text_tokens = len(AutoTokenizer.from_pretrained(demo_models.resolve(LLAVA)).encode(multimodal.TWO_IMAGE_PROMPT))
    expected = text_tokens + 2 * (tiny_llava.IMAGE_TOKENS - 1)  # each `<image>` becomes 16 tokens
    before = metric(scrape(image_server), "vllm:prompt_tokens_total", STEPS8) or 0.0
    result = _ok(
        _generate(image_server, STEPS8, multimodal.TWO_IMAGE_PROMPT, [RED, NOISE], return_num_input_tokens=True)
    )
    assert int(result.data_responses[0]["num_input_tokens"][0]) == expected
    assert metric(scrape(image_server), "vllm:prompt_tokens_total", STEPS8) - before == expected


def test_an_image_in_an_openai_chat_gets_the_kserve_answer_counted_with_its_image_tokens(
    image_server: ServerProcess,
) -> None:
    """The OpenAI API (`--openai-port`): an image_url data URL in a chat message becomes the model's
    `image` input beside the chat template's `<image>` placeholder, as under `vllm serve`."""
    import openai

    client = openai.OpenAI(base_url=f"{image_server.openai_url}/v1", api_key="unused", max_retries=0)
    from transformers import AutoTokenizer

    prompt = "<s>user: <image>\nWhat is in the image?\nassistant:"  # the chat template's rendering
    ids = AutoTokenizer.from_pretrained(demo_models.resolve(LLAVA)).encode(prompt, add_special_tokens=False)
    answers = {}
    for name, image in (("red", RED), ("noise", NOISE)):
        url = "data:image/png;base64," + multimodal.encode_image(image).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is in the image?"}]
        chat = client.chat.completions.create(
            model=STEPS8,
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        # What vLLM's chat code sends: the template's text, tokenized without adding special tokens.
        inputs = make_inputs(grpcclient, input_ids=ids, sampling=SAMPLING, stream=True, return_num_input_tokens=True)
        kserve = _ok(grpc_generate(image_server.grpc_url, STEPS8, inputs=[*inputs, _image_input([image])], timeout=300))
        assert chat.choices[0].message.content == kserve.text(), name
        assert chat.usage.prompt_tokens == int(kserve.data_responses[0]["num_input_tokens"][0]) > 20
        answers[name] = chat.choices[0].message.content
    assert answers["red"] != answers["noise"]


def test_the_ensemble_passes_the_image_to_the_llm(image_server: ServerProcess) -> None:
    direct = _ok(_generate(image_server, STEPS8, multimodal.IMAGE_PROMPT, [NOISE]))
    through = _ok(_generate(image_server, "ensemble", multimodal.IMAGE_PROMPT, [NOISE]))
    assert through.text() == direct.text() and direct.text()
    text_only = _ok(_generate(image_server, "ensemble", multimodal.IMAGE_PROMPT.replace("<image>\n", ""), []))
    assert text_only.text() != direct.text()


def _refusal(server: ServerProcess, prompt: str, images: list[Image.Image | bytes]) -> str:
    result = _generate(server, STEPS8, prompt, images)
    assert result.finals == 1 and result.error is not None and not result.data_responses
    return result.error


def test_bad_images_fail_alone_naming_the_input_and_the_model_serves_on(image_server: ServerProcess) -> None:
    good = multimodal.encode_image(RED)
    big = multimodal.encode_image(multimodal.solid_image(size=(300, 300)))  # 90,000 pixels > 65,536
    noisy = multimodal.encode_image(multimodal.noise_image(size=(256, 256)))  # ~260 kB of base64
    prompt = multimodal.IMAGE_PROMPT
    cases = {
        "not base64": (prompt, [b"%%% not base64 %%%"], "input 'image' element 0 is not base64"),
        "not an image": (prompt, [b"aGVsbG8gd29ybGQ="], "input 'image' element 0 is not an image PIL can read"),
        "too many": (
            multimodal.TWO_IMAGE_PROMPT,
            [good, good, good],
            "input 'image' holds 3 images, more than this model's limit of 2 per prompt",
        ),
        "too many pixels": (prompt, [big], "element 0 is 300x300 = 90000 pixels, over this model's max_image_pixels"),
        "too many bytes": (prompt, [noisy], "over this model's max_image_bytes of 200000"),
        # vLLM's own check: the prompt's placeholders and the images must match.
        "no placeholder": (multimodal.TEXT_PROMPT, [good], "the image prompt cannot be processed"),
    }
    with ThreadPoolExecutor(len(cases) + 1) as pool:
        running = pool.submit(_generate, image_server, STEPS8, prompt, [NOISE])
        refusals = {name: pool.submit(_refusal, image_server, p, images) for name, (p, images, _) in cases.items()}
        for name, (_, _, expected) in cases.items():
            assert expected in refusals[name].result(), (name, refusals[name].result())
        assert len(_ok(running.result()).token_ids()) == MAX_TOKENS  # a stream in flight is untouched
    assert "(the request has 1 image)" in refusals["no placeholder"].result()
    assert _ok(_generate(image_server, STEPS8, prompt, [RED])).token_ids()


def test_an_m_rope_model_fails_its_load_with_multi_step_naming_why(image_server: ServerProcess) -> None:
    # Closed at once: Triton's gRPC server otherwise waits ~20 s at stop for a channel that saw a failed load.
    with (
        grpcclient.InferenceServerClient(image_server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.load_model(MROPE)
    message = str(raised.value)
    assert "num_scheduler_steps=8 cannot serve this model" in message and "uses M-RoPE" in message
    assert "set num_scheduler_steps to 1 for this model" in message
    assert not model_ready(image_server, MROPE)
    assert _ok(_generate(image_server, STEPS8, multimodal.IMAGE_PROMPT, [RED])).token_ids()


def test_the_openai_server_stops_with_the_server(image_server: ServerProcess) -> None:
    """Last in the module: the server is stopped (the OpenAI checks share a server that stays up)."""
    frontends = image_server.running_with(openai_process.FRONTEND_MODULE)
    assert len(frontends) == 1
    assert image_server.stop() == 0
    assert not frontends[0].is_running() or frontends[0].status() == "zombie"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{image_server.openai_url}/health", timeout=5)
