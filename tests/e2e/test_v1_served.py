"""A `vllm_engine: v1` model through the real server: vLLM's current engine (.venv-v1) behind the
same tensors, streaming one response per decoded step with exactly the tokens of `vllm serve` of
the V1 environment (vLLM 0.32's own OpenAI server, same model and settings; greedy and seeded),
streamed = whole; text prompts tokenized and each step's text made in the V1 environment, shown
with a model this environment's transformers cannot load (a tiny random SmolLM3); structured output
and multi-LoRA as V1's own; prefix caching; the KV-cache gauges under both engines' names; the
README's V1 block (SmolLM2 on V1, made by its commands, answering its client command as `vllm
serve` does); what V1 removed is refused for that request alone; multi-step settings, an adapter
vLLM refuses and an image model on CPU fail a V1 model's load saying so; async scheduling asked in
model.json is kept on CPU; unloading drains streams in flight; a dead V1 engine core fails its
model alone, and the probe says so.

Owns the served V1 checks on a server of its own (the tiny demo model, the SmolLM3 and the
README's SmolLM2 on V1; the engine-process seam is tests/engine/test_v1_engine_process.py's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from private_servers import (
    REPO_ROOT,
    add_v1_pipeline,
    assert_the_drain_counted_the_streams_going,
    engine_processes,
    loaded_into,
    make_repository,
    metric,
    model_ready,
    readme_repository,
    scrape,
    serving,
    stub_without_torch,
    unloads,
    wait_for,
    watch_as_a_router,
)
from served_models import TINY_ENGINE
from triton_clients import aio_generate, grpc_generate, make_inputs
from tritonclient.utils import InferenceServerException

from triton_vllm_multistep.checks import adapters
from triton_vllm_multistep.checks.v1_reference import offline_v1_outputs, run_v1_script
from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.engine_v1.cpu_compile_cache import AOT_COMPILE_ENV
from triton_vllm_multistep.host import probe
from triton_vllm_multistep.output_tap import TAP_KEY_PARAMETER, TAP_SOCKET_PARAMETER
from triton_vllm_multistep.settings.v1_environment import v1_environment_python
from triton_vllm_multistep.stub import tap_writer
from triton_vllm_multistep.testing import smollm3, vllm_serve
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, free_ports
from triton_vllm_multistep.testing.output_tap import TapThread
from triton_vllm_multistep.testing.vllm_serve import openai_chat, openai_completion

V1 = "llm_v1"
V1_WITH_STEPS = "llm_v1_with_steps"
V1_ENGINE = {"num_scheduler_steps": None, "enforce_eager": True}
TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": TOKENS, "ignore_eos": True}
SEVERAL = {**SEEDED, "n": 2}  # n completions: V1 samples each with a seed of its own (seed + index)
PROMPTS = ((1, 5, 9, 12, 40), (3, 4, 5), (7, 8, 2, 2, 6, 100, 3))
SMOLLM3 = "smollm3_v1"  # served on V1; transformers 4.51 (this environment's) cannot load it
SMOLLM3_PROMPT_LIMIT = 24  # its config.pbtxt max_prompt_tokens
# The ensemble over smollm3_v1 (docs/ensemble.md): its preprocessing stage with `vllm_engine: v1`.
ENSEMBLE_V1, PREPROCESSING_V1, POSTPROCESSING_V1 = "ensemble_v1", "preprocessing_v1", "postprocessing_v1"
SHORT_CHAT = [{"role": "user", "content": "Hi"}]  # 17 tokens with the chat template: within SmolLM3's 24
TEXT_PROMPTS = ("The capital of France is", "hello world, hello", "a b c d e f g")
README_REPOSITORY, README_MODEL = "/tmp/v1_repository", "vllm_model"
STRUCTURED = {
    "choice": ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    "regex": ({"regex": "[a-c]{2}[0-9]{3}"}, lambda text: re.fullmatch("[a-c]{2}[0-9]{3}", text) is not None),
}
STRUCTURED_PROMPT, STRUCTURED_SAMPLING = "Answer:", {"temperature": 0.0, "max_tokens": 16}
PROMPT_LOGPROBS = {"temperature": 0.0, "max_tokens": 4, "prompt_logprobs": 3}
LOGPROB_TOLERANCE = 5e-3  # logprobs of two engines (or batches) of the same vLLM
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_SAMPLING = {"max_tokens": 24, "temperature": 0.0}


V1_LORA = "llm_v1_lora"
V1_BIASED_LORA = "llm_v1_biased_lora"  # multi_lora.json names an adapter with a bias
V1_IMAGES = "llm_v1_images"  # the tiny LLaVA demo model on V1
V1_SMALL_CACHE = "llm_v1_small_cache"
# scheduling_policy "priority", one sequence at a time, and engine_cpus "last 1": one model for the
# priority and the CPU-placement tests (one V1 load less; one CPU also slows the long request the
# priority test holds in flight).
V1_PRIORITY = V1_PINNED = "llm_v1_priority_pinned"
EMBEDDING_MODEL, V1_EMBEDDING = "embedding_model", "embedding_v1"  # the shipped embedding model, on V1
V1_LORA_ENGINE = {**V1_ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
LORA_NAMES = ("doll", "sheep")  # multi_lora.json's order: lora_int_id 1, 2
SHIPPED_MODEL = REPO_ROOT / "model_repository" / "vllm_model"


def lora_adapters(root: Path) -> dict[str, Path]:
    """Two PEFT adapters of the tiny model (checks/adapters.py), made once per server."""
    model_dir = demo_models.build("tiny-llama-bpe")
    return {
        "doll": adapters.write_adapter(model_dir, root / "adapter-doll", seed=11),
        "sheep": adapters.write_adapter(
            model_dir, root / "adapter-sheep", seed=12, target_modules=(*adapters.MLP, "v_proj")
        ),
    }


def v1_python() -> Path:
    python = v1_environment_python()
    assert python is not None, "scripts/setup.sh builds .venv-v1"
    return Path(python)


@pytest.fixture(scope="module")
def v1_server(
    tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict, reference: dict
) -> Iterator[ServerProcess]:
    """The V1 models' server; started once `vllm serve`'s reference answers are in and its server is
    gone (the two side by side cost ~3 GB more at once)."""
    root: Path = tmp_path_factory.mktemp("v1_served")
    smollm3_engine = {**V1_ENGINE, "model": str(smollm3.build(v1_python()))}
    readme_made = readme_repository(README_REPOSITORY, root / "readme_v1_repository")
    repository = make_repository(
        root,
        {
            # Async scheduling forced on (vLLM turns it off on CPU): every llm_v1 check holds with it.
            V1: {"engine": {**V1_ENGINE, "async_scheduling": True}, "parameters": {"vllm_engine": "v1"}},
            V1_WITH_STEPS: {"engine": {"enforce_eager": True}, "parameters": {"vllm_engine": "v1"}},
            SMOLLM3: {
                "engine": smollm3_engine,
                "parameters": {"vllm_engine": "v1", "max_prompt_tokens": str(SMOLLM3_PROMPT_LIMIT)},
            },
        },
    )
    # The ensemble over SmolLM3 (its tokenizer too is one this environment cannot load), loaded by its
    # test; a postprocessing stage with `vllm_engine: v1`, whose load fails saying why.
    add_v1_pipeline(repository, SMOLLM3, smollm3_engine["model"], ENSEMBLE_V1, PREPROCESSING_V1)
    shutil.copytree(REPO_ROOT / "model_repository" / "postprocessing", repository / POSTPROCESSING_V1)
    config = repository / POSTPROCESSING_V1 / "config.pbtxt"
    config.write_text(config.read_text() + '\nparameters { key: "vllm_engine" value: { string_value: "v1" } }\n')
    # The README's V1 model (SmolLM2 on V1, made by the README's commands), as it names it.
    shutil.copytree(readme_made / README_MODEL, repository / README_MODEL)
    # Multi-LoRA as Triton's vLLM backend configures it: multi_lora.json beside model.json.
    copy_model(SHIPPED_MODEL, repository / V1_LORA, {**TINY_ENGINE, **V1_LORA_ENGINE}, {"vllm_engine": "v1"})
    for name, folder in lora_adapters(root).items():
        shutil.copytree(folder, repository / V1_LORA / "1" / "adapters" / name)
    entries = {name: f"adapters/{name}" for name in LORA_NAMES}
    (repository / V1_LORA / "1" / "multi_lora.json").write_text(json.dumps(entries))
    # Loaded by their tests, each failing: an adapter only vLLM's own load refuses; an image model on CPU.
    copy_model(SHIPPED_MODEL, repository / V1_BIASED_LORA, {**TINY_ENGINE, **V1_LORA_ENGINE}, {"vllm_engine": "v1"})
    adapters.write_biased_adapter(
        demo_models.build("tiny-llama-bpe"), repository / V1_BIASED_LORA / "1" / "adapters" / "biased", seed=15
    )
    (repository / V1_BIASED_LORA / "1" / "multi_lora.json").write_text(json.dumps({"biased": "adapters/biased"}))
    copy_model(SHIPPED_MODEL, repository / V1_IMAGES, {**TINY_ENGINE, **V1_ENGINE, "model": "demo://tiny-llava"},
               {"vllm_engine": "v1"})  # fmt: skip
    # Eight 128-token KV blocks (seven usable: one is V1's null block): eight streams of three blocks each
    # overfill them for the whole run, so that any scrape during it sees several running and some
    # waiting (the router metrics' test loads it; with three usable blocks the run alternated between
    # one and two running, and a loaded CI host's scrapes, seconds apart, saw only one).
    small_cache = {**V1_ENGINE, "max_model_len": 384, "num_gpu_blocks_override": 8}
    copy_model(SHIPPED_MODEL, repository / V1_SMALL_CACHE, {**TINY_ENGINE, **small_cache}, {"vllm_engine": "v1"})
    # The model's whole length (2,048 positions): the priority test holds one long request in flight.
    priority = {**V1_ENGINE, "scheduling_policy": "priority", "max_num_seqs": 1, "max_model_len": 2048}
    copy_model(SHIPPED_MODEL, repository / V1_PRIORITY, {**TINY_ENGINE, **priority},
               {"vllm_engine": "v1", "engine_cpus": "last 1"})  # fmt: skip
    # The shipped embedding model on V1 (vLLM 0.32 finds an embedding model itself: no `task`), loaded by its test.
    copy_model(REPO_ROOT / "model_repository" / EMBEDDING_MODEL, repository / V1_EMBEDDING,
               {"task": None, "enforce_eager": True}, {"vllm_engine": "v1"})  # fmt: skip
    # The README's model (SmolLM2 on V1, ~3 GB of processes) is loaded by its test only: beside the
    # SmolLM2 server of the other worker it brought the host within 1 GB of its memory.
    loaded = (V1, SMOLLM3, V1_LORA)
    # The OpenAI API on its port, serving llm_v1 and the LoRA model (a V1 model's server each: ~0.6 GB).
    (openai_port,) = free_ports(1)
    openai = (f"--openai-port={openai_port}", f"--openai-args=--triton-model={V1} --triton-model={V1_LORA}")
    args = ("--model-control-mode=explicit", *(f"--load-model={m}" for m in loaded), *openai)
    with serving(repository, root / "tritonserver.log", *args) as server:
        server.wait_openai_ready()
        yield server
    # Every stub exited when its model was unloaded (a V1 stub that kept a request batch to its exit
    # aborted there, or never exited: stub/codec.py import_sampling_checks).
    log = (root / "tritonserver.log").read_text(errors="replace")
    assert "Exit timeout expired" not in log and "lock_exception" not in log, log[-5000:]


def served_fields(model: str) -> dict:
    """model.json's engine arguments as served (the CPU config's float32, the shipped seed)."""
    fields = {**TINY_ENGINE, **V1_ENGINE, "model": model, "seed": 0, "dtype": "float32"}
    return {key: value for key, value in fields.items() if value is not None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> dict[str, Any]:
    """The tiny model's answers from `vllm serve` of the V1 environment (vLLM 0.32's own OpenAI
    server, the same engine arguments): the id prompts' (greedy, seeded; whole, and streamed, which
    must agree) and the structured ones' (V1's `structured_outputs`)."""
    log = tmp_path_factory.mktemp("vllm_serve_v1") / "vllm_serve.log"
    fields = served_fields(str(demo_models.build("tiny-llama-bpe")))
    answers: dict[str, Any] = {}
    with vllm_serve.serving(v1_python(), fields, V1, log, {"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
        for kind, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            for i, ids in enumerate(PROMPTS):
                whole_ids, whole_text, _ = server.completion(ids, sampling, stream=False)
                streamed_ids, streamed_text, chunks = server.completion(ids, sampling, stream=True)
                # vLLM's AsyncLLM hands out one delta per token while its consumer keeps up and merges
                # them, still exact, when it falls behind (seen once on a loaded host: 23 chunks for
                # 24 tokens): the reference's chunks are not this backend's contract, its tokens are.
                assert (streamed_ids, streamed_text) == (whole_ids, whole_text) and 1 < chunks <= TOKENS
                answers[f"{kind}-{i}"] = (whole_ids, whole_text)
        for kind, (constraint, _) in STRUCTURED.items():
            structured = {**STRUCTURED_SAMPLING, "structured_outputs": constraint}
            ids, text, _ = server.completion(STRUCTURED_PROMPT, structured, stream=False)
            answers[kind] = (ids, text)
        answers["prompt_logprobs"] = server.prompt_logprobs(PROMPTS[0], PROMPT_LOGPROBS)
        several = vllm_serve.openai_choices(server.http_url, V1, PROMPTS[0], SEVERAL, stream=False)
        assert vllm_serve.openai_choices(server.http_url, V1, PROMPTS[0], SEVERAL, stream=True) == several
        answers["several"] = several
    return answers


@pytest.mark.parametrize(("kind", "sampling"), [("greedy", GREEDY), ("seeded", SEEDED)])
def test_v1_streams_one_response_per_step_with_vllm_serves_tokens_and_whole_equals_streamed(
    v1_server: ServerProcess, reference: dict[str, tuple[list[int], str]], kind: str, sampling: dict
) -> None:
    for i, ids in enumerate(PROMPTS):
        served_ids, served_text = reference[f"{kind}-{i}"]
        streamed = grpc_generate(v1_server.grpc_url, V1, input_ids=list(ids), sampling=sampling, stream=True)
        assert streamed.error is None and streamed.finals == 1, streamed.error
        assert streamed.token_ids() == served_ids and streamed.text() == served_text
        assert [len(r["output_ids"]) for r in streamed.data_responses] == [1] * TOKENS  # one per step
        whole = grpc_generate(v1_server.grpc_url, V1, input_ids=list(ids), sampling=sampling, stream=False)
        assert whole.error is None and whole.token_ids() == streamed.token_ids()
        assert whole.text() == streamed.text()


def test_prompt_logprobs_on_v1_are_vllm_serves_on_the_first_response_streamed_and_whole(
    v1_server: ServerProcess, reference: dict[str, Any]
) -> None:
    """`prompt_logprobs` on V1: the prompt's logprobs (null for its first token) on the first response
    only, the same streamed and whole, and `vllm serve`'s candidates with its values (tolerance)."""
    answers = []
    for stream in (True, False):
        result = grpc_generate(
            v1_server.grpc_url, V1, input_ids=list(PROMPTS[0]), sampling=PROMPT_LOGPROBS, stream=stream
        )
        assert result.error is None and len(result.token_ids()) == PROMPT_LOGPROBS["max_tokens"], result.error
        assert [i for i, response in enumerate(result.responses) if "prompt_logprobs" in response] == [0]
        answers.append(json.loads(result.responses[0]["prompt_logprobs"][0]))
    assert answers[0] == answers[1]
    theirs = reference["prompt_logprobs"]
    assert answers[0][0] is None and theirs[0] is None and len(answers[0]) == len(theirs) == len(PROMPTS[0])
    for position, (ours, expected) in enumerate(zip(answers[0][1:], theirs[1:], strict=True), start=1):
        assert set(ours) == set(expected), position
        for token, entry in ours.items():
            assert entry["logprob"] == pytest.approx(expected[token], abs=LOGPROB_TOLERANCE), (position, token)


def test_async_scheduling_asked_in_model_json_is_kept_on_cpu_and_not_imposed(v1_server: ServerProcess) -> None:
    """llm_v1 asks for it (and equals `vllm serve` without it, above); the other V1 models do not."""
    log = v1_server.log_path.read_text(errors="replace")
    assert re.search(rf"model {V1} \(.*?\) ready: num_scheduler_steps=1 \(async scheduling\), streaming", log)
    assert re.search(rf"model {SMOLLM3} \(.*?\) ready: num_scheduler_steps=1, streaming", log)


def test_a_field_v1_removed_or_refuses_fails_that_request_alone_in_v1s_words(v1_server: ServerProcess) -> None:
    """Checked by the V1 engine process with V1's SamplingParams: its stub imports no vLLM (it maps no
    libtorch), so no rule of vLLM 0.8.5's stands in for V1's."""
    refused = grpc_generate(v1_server.grpc_url, V1, input_ids=[1, 2, 3], sampling={**SEEDED, "best_of": 3})
    assert refused.error is not None and "vLLM's V1 engine removed best_of" in refused.error
    out_of_range = grpc_generate(v1_server.grpc_url, V1, input_ids=[1, 2, 3], sampling={**SEEDED, "top_p": 1.5})
    assert out_of_range.finals == 1 and out_of_range.error is not None
    assert "top_p must be in (0, 1], got 1.5" in out_of_range.error, out_of_range.error
    after = grpc_generate(v1_server.grpc_url, V1, input_ids=[1, 2, 3], sampling=GREEDY, stream=True)
    assert after.error is None and len(after.token_ids()) == TOKENS
    print(f"{V1} stub: {stub_without_torch(v1_server, V1):.0f} MB resident")


def test_num_scheduler_steps_on_a_v1_model_fails_its_load_naming_both(v1_server: ServerProcess) -> None:
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        with pytest.raises(Exception, match="'vllm_engine'='v1' and model.json 'num_scheduler_steps'=8 disagree"):
            client.load_model(V1_WITH_STEPS)
    assert model_ready(v1_server, V1) and not model_ready(v1_server, V1_WITH_STEPS)


def test_a_model_this_environments_transformers_cannot_load_serves_text_on_v1_exactly(
    v1_server: ServerProcess,
) -> None:
    """Text in, text out, with nothing of the model loaded in .venv: the V1 engine process tokenizes
    the prompt and makes each step's text. Greedy and seeded, streamed one response per step, equal
    to V1's offline LLM on the same text (ids and text); whole = streamed, the prompt prepended as
    Triton's vLLM backend does for a whole answer."""
    import transformers

    path = smollm3.build(v1_python())
    with pytest.raises(ValueError, match="does not recognize this architecture"):
        transformers.AutoConfig.from_pretrained(path)
    samplings = {"greedy": GREEDY, "seeded": SEEDED}
    requests = [(f"{kind}-{i}", text, sampling) for kind, sampling in samplings.items()
                for i, text in enumerate(TEXT_PROMPTS)]  # fmt: skip
    offline = offline_v1_outputs(v1_python(), served_fields(str(path)), requests)
    for request_id, text, sampling in requests:
        ids, answer = offline[request_id]
        streamed = grpc_generate(
            v1_server.grpc_url, SMOLLM3, prompt=text, sampling=sampling, stream=True, return_num_input_tokens=True
        )
        assert streamed.error is None and streamed.finals == 1, streamed.error
        assert streamed.token_ids() == ids, request_id
        assert streamed.text() == answer, request_id
        # The prompt's length as the V1 process counted it, in every response.
        counts = {int(r["num_input_tokens"][0]) for r in streamed.data_responses}
        assert len(counts) == 1 and counts.pop() >= len(text.split()), request_id
        assert [len(r["output_ids"]) for r in streamed.data_responses] == [1] * TOKENS
        whole = grpc_generate(v1_server.grpc_url, SMOLLM3, prompt=text, sampling=sampling, stream=False)
        assert whole.error is None and whole.token_ids() == ids
        assert whole.text() == text + answer


def test_the_ensemble_on_a_v1_model_tokenizes_in_the_v1_environment_and_streams_the_models_text(
    v1_server: ServerProcess,
) -> None:
    """The ensemble as docs/ensemble.md writes it for a V1 model: the preprocessing stage with
    `vllm_engine: v1` (SmolLM3's tokenizer, which this environment's transformers cannot load, loaded in
    the V1 environment) → smollm3_v1, whose text_output is the ensemble's. Text in: the tokens and text
    the model gives for the same text itself, streamed one response per step and whole; chat messages:
    the model's answer to the V1 tokenizer's chat template. A postprocessing stage with `vllm_engine:
    v1` fails its load saying why; a V1 model asked for windows refuses that request alone."""
    import numpy as np
    import transformers

    path = str(smollm3.build(v1_python()))
    with pytest.raises(ValueError, match="TokenizersBackend does not exist"):
        transformers.AutoTokenizer.from_pretrained(path)
    url = v1_server.grpc_url
    with grpcclient.InferenceServerClient(url) as client:
        client.load_model(ENSEMBLE_V1)
    try:
        stub_without_torch(v1_server, PREPROCESSING_V1)  # the tokenizer runs in the V1 environment's process
        for text in TEXT_PROMPTS:
            direct = grpc_generate(url, SMOLLM3, prompt=text, sampling=GREEDY, stream=True)
            streamed, whole = (
                grpc_generate(
                    url, ENSEMBLE_V1, inputs=make_inputs(grpcclient, prompt=text, sampling=GREEDY, stream=stream)
                )
                for stream in (True, False)
            )
            for result in (direct, streamed, whole):
                assert result.error is None and result.finals == 1, (text, result.error)
            assert streamed.token_ids() == direct.token_ids() and streamed.text() == direct.text(), text
            assert [len(r["output_ids"]) for r in streamed.data_responses] == [1] * TOKENS
            assert whole.token_ids() == direct.token_ids() and whole.text() == direct.text(), text
        script = (
            "import json, sys\nfrom transformers import AutoTokenizer\n"
            "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "messages = json.loads(sys.stdin.read())\n"
            "text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)\n"
            "print('CHAT-IDS', json.dumps(tokenizer.encode(text, add_special_tokens=False)))\n"
        )
        stdout = run_v1_script(v1_python(), script, (path,), json.dumps(SHORT_CHAT), "the V1 chat template", {})
        (line,) = [line for line in stdout.splitlines() if line.startswith("CHAT-IDS ")]
        chat_ids = json.loads(line.removeprefix("CHAT-IDS "))
        direct = grpc_generate(url, SMOLLM3, input_ids=chat_ids, sampling=GREEDY, stream=True)
        messages = grpcclient.InferInput("messages", [1], "BYTES")
        messages.set_data_from_numpy(np.array([json.dumps(SHORT_CHAT).encode()], dtype=np.object_))
        chat_inputs = [*make_inputs(grpcclient, sampling=GREEDY, stream=True), messages]
        chat = grpc_generate(url, ENSEMBLE_V1, inputs=chat_inputs)
        assert chat.error is None and direct.error is None, (chat.error, direct.error)
        assert chat.token_ids() == direct.token_ids() and chat.text() == direct.text()
        windows = grpc_generate(url, SMOLLM3, input_ids=[5, 6], sampling=GREEDY, stream=True,
                                return_detokenization_window=True)  # fmt: skip
        assert windows.error is not None and "map it to the ensemble's text_output" in windows.error, windows.error
        with grpcclient.InferenceServerClient(url) as client, pytest.raises(InferenceServerException) as refused:
            client.load_model(POSTPROCESSING_V1)
        assert "text_output is each step's exact text already" in str(refused.value), refused.value
    finally:
        with grpcclient.InferenceServerClient(url) as client:
            client.unload_model(ENSEMBLE_V1)
            client.unload_model(PREPROCESSING_V1)


def test_a_text_prompt_over_the_limit_fails_alone_in_the_stubs_words(v1_server: ServerProcess) -> None:
    """The V1 environment counts a text prompt's tokens; over config.pbtxt max_prompt_tokens it is
    refused in the words the stub uses for token ids, that request alone."""
    long_prompt = " ".join(["hello world"] * 40)
    refused = grpc_generate(v1_server.grpc_url, SMOLLM3, prompt=long_prompt, sampling=GREEDY, stream=True)
    assert refused.error is not None and refused.finals == 1
    limit_words = rf"the prompt has \d+ tokens, more than this model's limit of {SMOLLM3_PROMPT_LIMIT}"
    assert re.search(limit_words, refused.error), refused.error
    ids_refused = grpc_generate(
        v1_server.grpc_url, SMOLLM3, input_ids=[5] * (SMOLLM3_PROMPT_LIMIT + 1), sampling=GREEDY, stream=True
    )
    assert ids_refused.error is not None
    assert f"the prompt has {SMOLLM3_PROMPT_LIMIT + 1} tokens, more than this model's limit" in ids_refused.error
    prepend_ids = grpc_generate(
        v1_server.grpc_url, SMOLLM3, input_ids=[5, 6], sampling=GREEDY, stream=False, exclude_input_in_output=False
    )
    assert prepend_ids.error is not None and "needs the prompt as 'text_input'" in prepend_ids.error
    after = grpc_generate(v1_server.grpc_url, SMOLLM3, prompt="hello", sampling=GREEDY, stream=True)
    assert after.error is None and len(after.token_ids()) == TOKENS


def test_a_v1_model_publishes_the_kv_cache_use_under_both_engines_names(v1_server: ServerProcess) -> None:
    """V1's scheduler stats feed the same gauges: vllm:kv_cache_usage_perc (V1's name) and
    vllm:gpu_cache_usage_perc (V0's), equal, above 0 while requests hold blocks, 0 after. The
    requests are held in flight until the gauge is seen (the state is sampled every 0.25 s; 400
    tokens once ended between two samples on a fast host)."""
    long = {**GREEDY, "max_tokens": 1000}
    seen_in_use = threading.Event()
    results: list[Any] = []
    running = [
        threading.Thread(
            target=lambda i=i: results.append(
                grpc_generate(
                    v1_server.grpc_url,
                    V1,
                    input_ids=[1, 2, 3 + i],
                    sampling=long,
                    stream=True,
                    cancel_when=seen_in_use,
                )
            )
        )  # fmt: skip
        for i in range(4)
    ]
    for thread in running:
        thread.start()
    seen: list[tuple[float | None, float | None]] = []

    def in_use() -> bool:
        text = scrape(v1_server)
        seen.append((metric(text, "vllm:kv_cache_usage_perc", V1), metric(text, "vllm:gpu_cache_usage_perc", V1)))
        return (seen[-1][0] or 0) > 0

    try:
        assert wait_for(in_use, 60, interval=0.05), seen[-3:]
    finally:
        seen_in_use.set()
        for thread in running:
            thread.join(timeout=120)
    # Still streaming when the gauge was read (else the reading proves nothing about these requests).
    assert [r.error for r in results].count("cancelled by test") >= 1, [r.error for r in results]
    assert seen[-1][0] == seen[-1][1]
    assert wait_for(lambda: metric(scrape(v1_server), "vllm:kv_cache_usage_perc", V1) == 0, 30)
    assert metric(scrape(v1_server), "vllm:gpu_cache_usage_perc", V1) == 0


def test_the_readmes_v1_model_answers_its_client_command_as_vllm_serve_does(v1_server: ServerProcess) -> None:
    """The README's V1 block: the shipped SmolLM2 model with `vllm_engine: v1` and no
    num_scheduler_steps (made by the README's own commands) answers the README's client command with
    the text `vllm serve` of the V1 environment (same model, same settings) gives for that prompt
    and the client's sampling."""
    engine = json.loads((REPO_ROOT / "model_repository" / README_MODEL / "1" / "model.json").read_text())
    assert "num_scheduler_steps" in engine  # the README's sed removes it from the copy
    prompt = "The capital of France is"
    fields = {
        **{key: value for key, value in engine.items() if key != "num_scheduler_steps"},
        "model": str(demo_models.build(engine["model"].removeprefix("demo://"))),
        "dtype": "float32",  # configs/cpu.pbtxt's engine_args
    }
    log = v1_server.log_path.parent / "vllm_serve_smollm2.log"
    # vLLM's compile cache as the served engine uses it on CPU (engine_v1/cpu_compile_cache.py): the same
    # compiled model, loaded from the cache the served model's start filled instead of compiled again.
    environment = {"VLLM_CPU_KVCACHE_SPACE": "1", AOT_COMPILE_ENV: "0"}
    # SmolLM2 beside this module's V1 engines and OpenAI servers while the other test worker's servers
    # run: once out of memory on this 24 GB host (the kernel killed SmolLM2's V1 worker). smollm3_v1 is
    # not needed meanwhile: unloaded (its ~2.4 GB of V1 engine processes gone), loaded again after.
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        client.unload_model(SMOLLM3)
    assert wait_for(lambda: not engine_processes(v1_server, SMOLLM3, v1=True), 120)
    try:
        answer, chat_answer, done, chats = _readme_answers(v1_server, prompt, fields, log, environment)
    finally:
        with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
            client.load_model(SMOLLM3)
    assert done.returncode == 0, done.stderr
    assert done.stdout == answer + "\n"
    assert answer.strip()
    # SmolLM2's chat template applied in the V1 environment: vllm serve's answer, whole and streamed per step.
    (whole, _), (streamed, chunks) = chats
    assert whole == streamed == chat_answer and "Paris" in chat_answer, (chats, chat_answer)
    assert chunks > 1
    # The unload completes: Triton waits for the stub's exit, which a kept request batch prevented.
    assert wait_for(lambda: unloads(v1_server, README_MODEL) >= 1, 60), v1_server.log_tail()


def _readme_answers(
    v1_server: ServerProcess, prompt: str, fields: dict[str, Any], log: Path, environment: dict[str, str]
) -> tuple[str, str, subprocess.CompletedProcess, list[tuple[str, int]]]:
    """`vllm serve`'s completion and chat answers of the README's model, then the served model's: the
    README's client command's run and the OpenAI API's chat answers (whole, streamed)."""
    with vllm_serve.serving(v1_python(), fields, README_MODEL, log, environment) as server:
        _, answer, _ = server.completion(prompt, {"max_tokens": 32, "temperature": 0.0}, stream=False)
        chat_answer, _ = openai_chat(server.http_url, README_MODEL, CHAT, CHAT_SAMPLING, stream=False)
    # Loaded once `vllm serve` is gone (both at once: ~6 GB of SmolLM2 processes), unloaded after.
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        client.load_model(README_MODEL)
    try:
        done = subprocess.run(
            [sys.executable, "client_examples/grpc_stream.py", prompt, "--url", v1_server.grpc_url],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=REPO_ROOT,
        )
        # The OpenAI API on its own beside the server (`python -m triton_vllm_multistep.frontend`), for it.
        with openai_api_of(v1_server, README_MODEL) as url:
            chats = [openai_chat(url, README_MODEL, CHAT, CHAT_SAMPLING, stream) for stream in (False, True)]
    finally:
        with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
            client.unload_model(README_MODEL)
    return answer, chat_answer, done, chats


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_output_on_v1_is_v1s_own_exactly_streamed_and_whole(
    v1_server: ServerProcess, reference: dict[str, tuple[list[int], str]], kind: str
) -> None:
    """A request's `guided_decoding` (Triton's vLLM backend's name) is V1's `structured_outputs`: the
    constrained answer equals `vllm serve`'s with structured_outputs, streamed = whole."""
    constraint, valid = STRUCTURED[kind]
    ids, answer = reference[kind]
    served = {**STRUCTURED_SAMPLING, "guided_decoding": constraint}
    streamed = grpc_generate(v1_server.grpc_url, V1, prompt=STRUCTURED_PROMPT, sampling=served, stream=True)
    assert streamed.error is None, streamed.error
    assert streamed.token_ids() == ids and streamed.text() == answer and valid(answer), (answer, streamed.text())
    whole = grpc_generate(
        v1_server.grpc_url, V1, prompt=STRUCTURED_PROMPT, sampling=served, stream=False, exclude_input_in_output=True
    )
    assert whole.error is None and whole.text() == answer


def test_multi_lora_on_v1_serves_each_adapter_as_v1s_offline_llm_with_it(v1_server: ServerProcess) -> None:
    """multi_lora.json's adapters and the base, by `lora_name`, greedy: each equals V1's offline LLM with
    that adapter (LoRARequest, alone in its batch), streamed one response per step, and again all
    three at once in one batch (vLLM 0.32's CPU LoRA alone gives the base an adapter's delta there:
    engine_v1/cpu_lora.py); the adapters change the answer; an unknown adapter fails alone."""
    repository_model = v1_server_repository_model(v1_server)
    fields = {**served_fields(str(demo_models.build("tiny-llama-bpe"))), **V1_LORA_ENGINE}
    fields = {key: value for key, value in fields.items() if value is not None}
    prompt = [1, 5, 9, 12, 40]
    names = ("base", *LORA_NAMES)
    requests = [("base", prompt, GREEDY, None)] + [
        (name, prompt, GREEDY, (name, index, str(repository_model / "1" / "adapters" / name)))
        for index, name in enumerate(LORA_NAMES, start=1)
    ]
    offline = offline_v1_outputs(v1_python(), fields, requests, separately=True)
    assert len({tuple(offline[name][0]) for name in names}) == 3  # the adapters act

    def generate(name: str) -> Any:
        sampling = GREEDY if name == "base" else {**GREEDY, "lora_name": name}
        return grpc_generate(v1_server.grpc_url, V1_LORA, input_ids=prompt, sampling=sampling, stream=True)

    for name in names:
        streamed = generate(name)
        assert streamed.error is None, streamed.error
        assert streamed.token_ids() == offline[name][0], name
        assert [len(r["output_ids"]) for r in streamed.data_responses] == [1] * TOKENS
    with ThreadPoolExecutor(len(names) * 2) as pool:
        together = list(pool.map(generate, names * 2))  # six requests, base and adapters in one batch
    for name, result in zip(names * 2, together, strict=True):
        assert result.error is None and result.token_ids() == offline[name][0], name
    unknown = grpc_generate(v1_server.grpc_url, V1_LORA, input_ids=prompt, sampling={**GREEDY, "lora_name": "ghost"})
    assert unknown.error is not None and "LoRA ghost is not supported" in unknown.error
    # Through the OpenAI API: each adapter served as a model (`<model>_lora_<adapter>`, and its own name).
    for served, name in ((V1_LORA, "base"), (f"{V1_LORA}_lora_doll", "doll"), ("sheep", "sheep")):
        for stream in (False, True):
            ids, _, _ = openai_completion(v1_server.openai_url, served, prompt, GREEDY, stream)
            assert ids == offline[name][0], (served, stream)


def v1_server_repository_model(server: ServerProcess) -> Path:
    """The LoRA model's folder in the server's repository (the adapters' paths as the stub sends them)."""
    return server.log_path.parent / "repository" / V1_LORA


def test_an_adapter_only_vllm_refuses_fails_the_v1_load_naming_it_and_the_server_serves_on(
    v1_server: ServerProcess,
) -> None:
    """multi_lora.json's adapters are loaded once by V1's engine core at the model's start, as on the
    multi-step engine: one vLLM refuses (a bias) fails the load naming it, not its first request."""
    with (
        grpcclient.InferenceServerClient(v1_server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.load_model(V1_BIASED_LORA)
    assert "LoRA adapter 'biased'" in str(raised.value) and "Adapter bias is not supported" in str(raised.value)
    assert not model_ready(v1_server, V1_BIASED_LORA)
    served = grpc_generate(v1_server.grpc_url, V1_LORA, input_ids=[1, 5, 9], sampling={**GREEDY, "lora_name": "doll"})
    assert served.error is None and len(served.token_ids()) == TOKENS


def test_an_image_model_on_v1_on_a_cpu_host_fails_its_load_saying_so(v1_server: ServerProcess) -> None:
    with (
        grpcclient.InferenceServerClient(v1_server.grpc_url) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.load_model(V1_IMAGES)
    message = str(raised.value)
    assert "LlavaForConditionalGeneration is a multimodal model: on vllm_engine 'v1'" in message, message
    assert "GPU hosts only" in message and "vllm_engine 'multistep'" in message
    assert model_ready(v1_server, V1) and not model_ready(v1_server, V1_IMAGES)


def test_prefix_caching_on_v1_reuses_a_shared_prompt_and_gives_the_same_tokens(v1_server: ServerProcess) -> None:
    """V1 caches prefixes by default: the same prompt again (its blocks now cached) streams the tokens
    it streamed cold (whole, the second time), greedy and seeded, and the hit-rate gauge shows the reuse.
    The system prompt fills more than one KV block (128 tokens on V1's CPU backend): only full blocks are
    cached. return_perf_metrics says so per request: no cached tokens the first time, whole blocks after,
    and the engine's timings in order within the client's."""
    system = "system: you are terse; answer in plain words, count like 1 2 3 when asked. " * 8 + "user: "
    cached: list[tuple[int, int]] = []
    for question in ("hello world", "the quick brown fox"):
        for sampling in (GREEDY, SEEDED):
            runs = [
                grpc_generate(
                    v1_server.grpc_url,
                    V1,
                    prompt=system + question,
                    sampling=sampling,
                    stream=stream,
                    return_perf_metrics=True,
                )
                for stream in (True, False)
            ]
            assert all(run.error is None for run in runs), [run.error for run in runs]
            assert runs[0].token_ids() == runs[1].token_ids() and len(runs[0].token_ids()) == TOKENS
            cached.append(tuple(run.perf_metrics()["num_cached_tokens"] for run in runs))
    first, *again = [count for pair in cached for count in pair]
    assert first == 0, cached  # the first time: nothing of it cached
    assert all(count >= 128 and count % 128 == 0 for count in again), cached
    hit_rate = "vllm:gpu_prefix_cache_hit_rate"
    assert wait_for(lambda: (metric(scrape(v1_server), hit_rate, V1) or 0) > 0, 30), metric(
        scrape(v1_server), hit_rate, V1
    )


def test_a_router_sees_a_v1_models_batch_fill_queue_and_preempt_with_vllms_metrics(v1_server: ServerProcess) -> None:
    """The gateway inference extension's view of a V1 model whose eight KV blocks eight streams overfill
    (tests/e2e/test_metrics.py has the multi-step engine's): running, waiting, the KV cache's use, the
    cache config; after: V1's own preemption and per-step token counts, each request's four phases."""
    streams, tokens = 8, 300
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        client.load_model(V1_SMALL_CACHE)
    try:
        sampling = {**GREEDY, "max_tokens": tokens}

        async def run_all() -> list:
            # One client, the streams sent together (eight client threads, each connecting on a busy
            # host, once reached the engine one by one: each ended before the next came).
            async with grpcaio.InferenceServerClient(v1_server.grpc_url) as client:
                jobs = [
                    aio_generate(client, V1_SMALL_CACHE, input_ids=[1, 5, 9 + i], sampling=sampling, stream=True)
                    for i in range(streams)
                ]
                return await asyncio.gather(*jobs)

        view = watch_as_a_router(v1_server, V1_SMALL_CACHE, lambda: asyncio.run(run_all()))
    finally:
        with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
            client.unload_model(V1_SMALL_CACHE)
    assert [(r.error, len(r.token_ids())) for r in view.result] == [(None, tokens)] * streams
    assert view.cache_config["num_gpu_blocks"] == "8" and view.cache_config["block_size"] == "128", view.cache_config
    view.assert_filled_queued_and_preempted(streams, streams * (3 + tokens))


@pytest.fixture(scope="module")
def priority_pinned(v1_server: ServerProcess) -> Iterator[ServerProcess]:
    """V1_PRIORITY (= V1_PINNED) loaded once for its two tests, unloaded after the last."""
    with loaded_into(v1_server, [V1_PRIORITY]) as server:
        yield server


def test_a_v1_model_with_the_priority_policy_schedules_an_urgent_waiting_request_first(
    priority_pinned: ServerProcess,
) -> None:
    """scheduling_policy "priority" on V1 (its meaning: the waiting queue in priority order): one
    sequence at a time; while a long request runs, a request of priority 5 queues, then one of
    priority 0; the long one is then cancelled: the urgent one is scheduled first. Each answer is the
    one llm_v1 gives alone. The long request is held until both wait (900 tokens once ended before
    the second arrived on a fast host)."""
    v1_server = priority_pinned
    seen: list[tuple[float, float]] = []  # (seconds since the long request's first response, waiting)
    try:
        running, both_waiting = threading.Event(), threading.Event()
        long: list[Any] = []
        thread = threading.Thread(
            target=lambda: long.append(
                grpc_generate(
                    v1_server.grpc_url, V1_PRIORITY, input_ids=[1, 5, 9], sampling={**GREEDY, "max_tokens": 2040},
                    stream=True, on_response=running.set, priority=5, cancel_when=both_waiting,
                )
            )
        )  # fmt: skip
        thread.start()
        assert running.wait(60)
        first_response = time.monotonic()
        queued: dict[str, Any] = {}

        def ask(name: str, priority: int, prompt: tuple[int, ...]) -> None:
            sampling = {**SEEDED, "priority": priority}
            queued[name] = grpc_generate(
                v1_server.grpc_url, V1_PRIORITY, input_ids=list(prompt), sampling=sampling, return_perf_metrics=True
            )

        def waiting() -> float:
            value = metric(scrape(v1_server), "vllm:num_requests_waiting", V1_PRIORITY) or 0
            seen.append((round(time.monotonic() - first_response, 2), value))
            return value

        asked = []
        for name, priority, prompt in (("later", 5, PROMPTS[1]), ("urgent", 0, PROMPTS[2])):
            asked.append(threading.Thread(target=ask, args=(name, priority, prompt)))
            asked[-1].start()
            count = len(asked)
            # Queued, in order (on failure: what was seen, and whether the long request had ended).
            assert wait_for(lambda count=count: waiting() >= count, 60, interval=0.02), (name, seen[-20:], long)
        both_waiting.set()
        for waiter in (*asked, thread):
            waiter.join(120)
    finally:
        both_waiting.set()
    assert long[0].error == "cancelled by test", long[0].error  # it held the one sequence until both waited
    assert all(r.error is None for r in queued.values()), [r.error for r in queued.values()]
    urgent, later_one = queued["urgent"].perf_metrics(), queued["later"].perf_metrics()
    assert urgent["arrival_time_ns"] > later_one["arrival_time_ns"]
    assert urgent["first_scheduled_time_ns"] < later_one["first_scheduled_time_ns"]
    for name, prompt in (("later", PROMPTS[1]), ("urgent", PROMPTS[2])):
        alone = grpc_generate(v1_server.grpc_url, V1, input_ids=list(prompt), sampling=SEEDED)
        assert queued[name].token_ids() == alone.token_ids() and len(alone.token_ids()) == TOKENS, name


def test_unloading_a_v1_model_lets_its_streams_in_flight_finish_then_ends_its_engine(v1_server: ServerProcess) -> None:
    """The drain on unload (config.pbtxt unload_drain_seconds) on V1: streams in flight complete whole,
    the server log says so, and the model's V1 engine process (and vLLM's core below it) ends. Near the
    end of this module: it takes llm_v1_lora down."""
    (engine,) = engine_processes(v1_server, V1_LORA, v1=True)
    core = vllm_core_processes(engine)
    # 1,000 tokens (the model's length is 1,024): still streaming when the unload comes, even on a fast
    # host (with 200, one stream once ended before it, and the log counted fewer in flight).
    long = {**GREEDY, "max_tokens": 1000}
    streaming = {name: threading.Event() for name in ("base", "doll")}
    results: list[Any] = []

    def stream(name: str) -> None:
        sampling = long if name == "base" else {**long, "lora_name": name}
        results.append(
            grpc_generate(
                v1_server.grpc_url,
                V1_LORA,
                input_ids=[1, 5, 9],
                sampling=sampling,
                stream=True,
                on_response=streaming[name].set,
            )
        )

    asked_at = time.time()
    threads = [threading.Thread(target=stream, args=(name,)) for name in streaming]
    for thread in threads:
        thread.start()
    assert all(event.wait(120) for event in streaming.values())
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        client.unload_model(V1_LORA)
    for thread in threads:
        thread.join(120)
    assert [(r.error, r.finals, len(r.token_ids())) for r in results] == [(None, 1, 1000)] * 2
    assert_the_drain_counted_the_streams_going(v1_server, V1_LORA, asked_at, [r.final_ns for r in results])
    assert "every request in flight finished while draining" in v1_server.log_path.read_text(errors="replace")
    assert wait_for(lambda: not model_ready(v1_server, V1_LORA), 60)
    # The OpenAI API serves it no longer: its health is the 503 vLLM answers for an engine gone.
    assert requests.get(f"{v1_server.openai_url}/health", timeout=30).status_code == 503
    for process in [engine, *core]:
        assert wait_for(lambda p=process: not p.is_running() or p.status() == "zombie", 60), process


@contextlib.contextmanager
def openai_api_of(server: ServerProcess, model: str) -> Iterator[str]:
    """This backend's OpenAI API started on its own beside `server` for `model` (loaded); its base URL.
    Stopped on the way out, with the V1 model's server it started (which ends with it)."""
    (port,) = free_ports(1)
    repository = server.log_path.parent / "repository"
    command = [
        *(sys.executable, "-m", "triton_vllm_multistep.frontend", f"--grpc-url={server.grpc_url}"),
        *(f"--model-repository={repository}", f"--triton-model={model}", "--host=127.0.0.1", f"--port={port}"),
    ]
    frontend = subprocess.Popen(command, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: frontend.poll() is not None or _healthy(url), 300), "the OpenAI API did not start"
        assert frontend.poll() is None, f"the OpenAI API exited with {frontend.returncode}"
        children = psutil.Process(frontend.pid).children()
        assert [child for child in children if "triton_vllm_multistep.frontend_v1" in child.cmdline()], children
        yield url
    finally:
        frontend.terminate()
        frontend.wait(60)
    # The V1 model's server ends with the server that started it (its parent death signal).
    assert wait_for(lambda: not any(_alive(child) for child in children), 30), children


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


@pytest.mark.parametrize(("kind", "sampling"), [("greedy", GREEDY), ("seeded", SEEDED)])
def test_the_openai_api_serves_a_v1_model_with_vllm_serves_tokens_whole_and_one_chunk_per_step(
    v1_server: ServerProcess, reference: dict[str, tuple[list[int], str]], kind: str, sampling: dict
) -> None:
    """The launcher's --openai-port: llm_v1 through vLLM 0.32's own app (its server under .venv-v1,
    routed to on the one port) gives `vllm serve`'s tokens and text, whole and streamed."""
    for i, ids in enumerate(PROMPTS):
        served_ids, served_text = reference[f"{kind}-{i}"]
        whole_ids, whole_text, _ = openai_completion(v1_server.openai_url, V1, ids, sampling, stream=False)
        assert (whole_ids, whole_text) == (list(served_ids), served_text), i
        streamed_ids, streamed_text, chunks = openai_completion(v1_server.openai_url, V1, ids, sampling, stream=True)
        assert (streamed_ids, streamed_text) == (whole_ids, whole_text) and chunks == TOKENS, (i, chunks)
    # Its model's stub wrote the data responses to the OpenAI server's output tap (output_tap.py).
    assert tap_writer.CONNECTED_MESSAGE in v1_server.log_path.read_text(errors="replace")


@pytest.mark.parametrize(("kind", "sampling"), [("greedy", GREEDY), ("seeded", SEEDED)])
def test_a_stream_that_names_an_output_tap_gets_its_data_there_and_only_its_final_through_triton(
    v1_server: ServerProcess, reference: dict[str, tuple[list[int], str]], kind: str, sampling: dict
) -> None:
    """KServe gRPC through tritonserver 2.51 with the tap's request parameters (as the OpenAI servers send
    them): one tap entry per step with `vllm serve`'s tokens and text, the last one final, and Triton's
    stream only the empty FINAL; a tap nobody answers at leaves the responses to Triton, unchanged."""
    tap = TapThread()
    try:
        for i, ids in enumerate(PROMPTS[:2]):
            served_ids, served_text = reference[f"{kind}-{i}"]
            inbox = tap.inbox(f"{kind}-{i}")
            asked = {TAP_SOCKET_PARAMETER: tap.path, TAP_KEY_PARAMETER: f"{kind}-{i}"}
            result = grpc_generate(
                v1_server.grpc_url, V1, input_ids=list(ids), sampling=sampling, stream=True, parameters=asked
            )
            assert result.error is None and result.finals == 1 and not result.data_responses, result.error
            items = tap.until_final(inbox)
            assert [len(item.values["output_ids"]) for item in items] == [1] * TOKENS  # one per step
            assert [token for item in items for token in item.values["output_ids"]] == list(served_ids)
            assert b"".join(item.values["text_output"][0] for item in items).decode() == served_text
        nobody = {TAP_SOCKET_PARAMETER: f"{tap.path}.absent", TAP_KEY_PARAMETER: "k"}
        result = grpc_generate(
            v1_server.grpc_url, V1, input_ids=list(PROMPTS[0]), sampling=sampling, stream=True, parameters=nobody
        )
        assert result.error is None and result.token_ids() == reference[f"{kind}-0"][0]
    finally:
        tap.close()


def completions_of(result: Any, n: int) -> list[tuple[list[int], str]]:
    """Each completion's (token ids, text) of a KServe result, its responses' arrays split per completion."""
    joined: list[tuple[list[int], str]] = [([], "")] * n
    for response in result.data_responses:
        counts, flat, start = response["num_output_tokens"].tolist(), response["output_ids"].tolist(), 0
        assert len(counts) == n, counts  # every response answers all n (index = position)
        for index, count in enumerate(counts):
            ids, text = joined[index]
            joined[index] = (ids + flat[start : start + count], text + response["text_output"][index].decode())
            start += count
    return joined


def test_n_completions_on_v1_stream_all_n_each_step_and_equal_vllm_serves(
    v1_server: ServerProcess, reference: dict[str, Any]
) -> None:
    """n > 1 on V1 (vLLM V1 streams each completion as an output of its own): over KServe each streamed
    response answers all n, at most one token each per step; over the OpenAI API V1's chunks per choice; both,
    whole and streamed, are `vllm serve`'s choices."""
    several = reference["several"]
    asked = {"input_ids": list(PROMPTS[0]), "sampling": SEVERAL, "return_num_output_tokens": True}
    streamed = grpc_generate(v1_server.grpc_url, V1, stream=True, **asked)
    assert streamed.error is None and streamed.finals == 1, streamed.error
    assert completions_of(streamed, 2) == [(list(ids), text) for ids, text in several]
    # One token per completion per step at most (V1 may schedule the second completion a step later).
    counts = [r["num_output_tokens"].tolist() for r in streamed.data_responses]
    assert all(max(step) <= 1 for step in counts), counts
    assert [sum(column) for column in zip(*counts, strict=True)] == [TOKENS] * 2
    whole = grpc_generate(v1_server.grpc_url, V1, **asked)
    assert whole.error is None and completions_of(whole, 2) == completions_of(streamed, 2)
    for stream in (False, True):
        assert vllm_serve.openai_choices(v1_server.openai_url, V1, PROMPTS[0], SEVERAL, stream) == several, stream


def test_the_openai_api_on_a_v1_model_lists_it_and_refuses_in_v1s_words(
    v1_server: ServerProcess,
) -> None:
    url = v1_server.openai_url
    listed = requests.get(f"{url}/v1/models", timeout=30).json()
    adapters = {f"{V1_LORA}_lora_{name}" for name in LORA_NAMES} | set(LORA_NAMES)
    assert {card["id"] for card in listed["data"]} == {V1, V1_LORA, *adapters}
    refused = requests.post(
        f"{url}/v1/completions", json={"model": V1, "prompt": [1, 2, 3], "max_tokens": 4, "top_p": 1.5}, timeout=60
    )
    assert refused.status_code == 400 and "top_p must be in (0, 1]" in refused.text, refused.text
    unknown = requests.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=60)
    assert unknown.status_code == 404, unknown.text


LEFT_STREAM_TOKENS = 1000


def test_a_client_that_leaves_a_v1_models_openai_stream_stops_its_request_in_the_engine(
    v1_server: ServerProcess,
) -> None:
    """Streamed /v1/completions of llm_v1 through the launcher's OpenAI API, with this module's other V1
    engines loaded: a client that leaves after a few chunks stops its request in the engine long before
    its end (with vLLM's MP executor on CPU its core and worker spun and starved the V1 model's API server
    for seconds: docs/openai.md; the worker now runs in the core process, engine_v1/cpu_executor.py).
    Each hop says so in the server log: the router stopped relaying, the V1 model's server cancelled
    the request in the model, the model's stub aborted it in the engine (on failure: which of them did)."""
    body = {"model": V1, "prompt": list(PROMPTS[0]), "max_tokens": LEFT_STREAM_TOKENS, "ignore_eos": True}
    for trial in range(3):
        before = metric(scrape(v1_server), "vllm:generation_tokens_total", V1) or 0.0
        log_from = len(v1_server.log_path.read_text(errors="replace"))
        with requests.post(
            f"{v1_server.openai_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60
        ) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert all(line.startswith(b"data:") or not line for line in received), received
        # Leaving the block closed the connection mid-stream.
        assert wait_for(lambda: metric(scrape(v1_server), "vllm:num_requests_running", V1) == 0, 30), trial
        time.sleep(1.0)
        generated = (metric(scrape(v1_server), "vllm:generation_tokens_total", V1) or 0.0) - before
        log = v1_server.log_path.read_text(errors="replace")[log_from:]
        hops = [line for line in log.splitlines() if "went away" in line or "cancelled by its client" in line]
        assert 0 < generated < LEFT_STREAM_TOKENS, (trial, generated, hops)
        assert any("/v1/completions went away mid-answer" in line for line in hops), (trial, hops)
        left = rf"request (\S+) left unanswered \(its client went away\): cancelled in {V1}$"
        cancelled = re.findall(left, log, re.M)
        assert len(cancelled) == 1, (trial, hops)
        aborted = f"request {cancelled[0]}-"  # the stub's id for it: Triton's request id, then its own
        assert any(aborted in line and "aborted in the engine" in line for line in hops), (trial, hops)


def test_a_v1_engine_core_that_dies_fails_its_requests_and_its_model_alone_and_the_probe_says_so(
    v1_server: ServerProcess,
) -> None:
    """vLLM V1's engine core (the process V1's LLMEngine drives) killed mid-stream: that stream ends with
    the engine's failure, the model reports an unhealthy engine and unloads itself (explicit mode),
    its engine process ends, the probe names it, and the other models serve on. Last in this module:
    it takes llm_v1 down."""
    # The server's group holds the OpenAI API's process too (this server has --openai-port).
    (tritonserver,) = [p for p in v1_server.process_groups()["tritonserver"] if p.name() == "tritonserver"]
    server_pid = tritonserver.pid
    assert probe.problems(probe.gather(server_pid, None, [V1, SMOLLM3])) == []
    (engine,) = engine_processes(v1_server, V1, v1=True)
    cores = vllm_core_processes(engine)
    assert len(cores) == 1, [child.cmdline() for child in engine.children()]
    first_response = threading.Event()
    in_flight: list[Any] = []
    long = {**GREEDY, "max_tokens": 600}

    def stream() -> None:
        in_flight.append(
            grpc_generate(
                v1_server.grpc_url,
                V1,
                input_ids=[1, 2, 3],
                sampling=long,
                stream=True,
                on_response=first_response.set,
                timeout=300,
            )
        )

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_response.wait(120)
    cores[0].kill()
    thread.join(300)
    (result,) = in_flight
    assert result.finals == 1 and result.error is not None and "vLLM engine failed" in result.error, result.error
    assert len(result.token_ids()) < long["max_tokens"]
    assert wait_for(lambda: not engine.is_running() or engine.status() == "zombie", 60)
    assert wait_for(lambda: not model_ready(v1_server, V1), 60)
    problems = probe.problems(probe.gather(server_pid, None, [V1, SMOLLM3]))
    assert problems and all(V1 in problem for problem in problems), problems
    after = grpc_generate(v1_server.grpc_url, SMOLLM3, prompt="hello", sampling=GREEDY, stream=True)
    assert after.error is None and len(after.token_ids()) == TOKENS


def test_engine_cpus_on_v1_puts_its_engine_process_and_vllms_core_on_them_and_the_stub_off_them(
    priority_pinned: ServerProcess, reference: dict[str, tuple[list[int], str]]
) -> None:
    """config.pbtxt `engine_cpus` on a V1 model: every thread of its engine process and of vLLM's engine
    core below it runs on the named CPU, the model's stub on the others; the answers stay `vllm serve`'s
    (one request at a time: the model's other settings, priority scheduling of one sequence, do not
    change them)."""
    v1_server = priority_pinned
    cpu = max(cpu_placement.allowed_cpus())  # "last 1"
    others = tuple(c for c in cpu_placement.allowed_cpus() if c != cpu)
    log = v1_server.log_path.read_text(errors="replace")
    assert re.search(rf"model {V1_PINNED} \(.*?\) ready: .*engine in a process of its own on CPUs {cpu},", log)
    (engine,) = engine_processes(v1_server, V1_PINNED, v1=True)
    (core,) = vllm_core_processes(engine)
    for process in (engine, core):
        threads = cpu_placement.thread_cpus(process.pid)
        assert threads and set(threads.values()) == {(cpu,)}, (process.cmdline(), threads)
    for i, ids in enumerate(PROMPTS):
        result = grpc_generate(v1_server.grpc_url, V1_PINNED, input_ids=list(ids), sampling=GREEDY, stream=True)
        assert result.error is None and (result.token_ids(), result.text()) == tuple(reference[f"greedy-{i}"])
    # Threads the stub started while serving (its responder's) stay off the engine's CPU too.
    assert set(cpu_placement.thread_cpus(engine.parent().pid).values()) == {others}


def vllm_core_processes(engine: Any) -> list[Any]:
    """vLLM's engine core below a V1 engine process (not multiprocessing's resource tracker)."""
    return [child for child in engine.children() if "resource_tracker" not in " ".join(child.cmdline())]


def test_the_embedding_model_on_v1_gives_sentence_transformers_embedding(
    v1_server: ServerProcess, references: Any
) -> None:
    """The shipped embedding model with `vllm_engine: v1` (no `task`: vLLM 0.32 finds it): Triton's vLLM
    backend's `embedding_request`, text tokenized in the V1 environment and token ids, one FINAL
    response each, equal to sentence-transformers' encode; its requests refused alone in the words of
    both engines (a generation request; `dimensions` for a model not trained for them: V1's vLLM).
    Through the OpenAI API (vLLM 0.32's embedding serving code over the model): /v1/embeddings gives
    the same vectors, float and base64, one input or a list, with usage; what the model's request
    cannot carry (`use_activation` off) and `dimensions` are 400s; it serves no completions."""
    import base64

    import numpy as np
    from references import EMBEDDING_TEXTS

    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        client.load_model(V1_EMBEDDING)
    try:
        over_kserve: dict[str, list[float]] = {}
        for text, ids, expected in zip(EMBEDDING_TEXTS, references.embedding_ids, references.embeddings, strict=True):
            for prompt in (text, ids):
                result = grpc_generate(
                    v1_server.grpc_url, V1_EMBEDDING, embedding_request={"input": prompt},
                    return_num_input_tokens=True, return_num_output_tokens=True,
                )  # fmt: skip
                assert result.error is None and result.finals == 1 and len(result.responses) == 1, result.error
                (response,) = result.responses
                vector = json.loads(response["text_output"][0])
                assert over_kserve.setdefault(text, vector) == vector  # text and its token ids alike
                found = np.array(vector, dtype=np.float32)
                np.testing.assert_allclose(found, expected, rtol=0, atol=1e-6)
                assert response["num_input_tokens"].tolist() == [len(ids)]
                assert response["num_output_tokens"].tolist() == [0]
        with openai_api_of(v1_server, V1_EMBEDDING) as url:

            def embeddings(**body: Any) -> requests.Response:
                return requests.post(f"{url}/v1/embeddings", json={"model": V1_EMBEDDING, **body}, timeout=120)

            listed = embeddings(input=list(EMBEDDING_TEXTS))
            assert listed.status_code == 200, listed.text
            answer = listed.json()
            assert [item["embedding"] for item in answer["data"]] == [over_kserve[t] for t in EMBEDDING_TEXTS]
            assert answer["usage"]["prompt_tokens"] == sum(len(ids) for ids in references.embedding_ids)
            text, ids = EMBEDDING_TEXTS[0], references.embedding_ids[0]
            encoded = embeddings(input=ids, encoding_format="base64")
            assert encoded.status_code == 200, encoded.text
            decoded = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype=np.float32)
            assert decoded.tolist() == over_kserve[text]
            raw = embeddings(input=text, use_activation=False)
            assert raw.status_code == 400 and "use_activation False is not served" in raw.text, raw.text
            shorter_api = embeddings(input=text, dimensions=8)
            assert shorter_api.status_code == 400 and "matryoshka" in shorter_api.text.lower(), shorter_api.text
            completion = requests.post(
                f"{url}/v1/completions", json={"model": V1_EMBEDDING, "prompt": "hi"}, timeout=60
            )
            assert completion.status_code in (400, 404), completion.text
        generate = grpc_generate(v1_server.grpc_url, V1_EMBEDDING, prompt="hi")
        assert generate.error is not None and generate.error.endswith(
            f"Error generating stream: Model {V1_EMBEDDING} does not support 'generate' request"
        ), generate.error
        shorter = grpc_generate(
            v1_server.grpc_url, V1_EMBEDDING, embedding_request={"input": "hi", "pooling_params": {"dimensions": [8]}}
        )
        assert shorter.error is not None and "matryoshka" in shorter.error.lower(), shorter.error
        # A V1 LLM still loaded at this point of the module (llm_v1 is unloaded by the drain test).
        embed_to_llm = grpc_generate(v1_server.grpc_url, SMOLLM3, embedding_request={"input": [1, 2, 3]})
        assert embed_to_llm.error is not None, embed_to_llm
        assert f"Model {SMOLLM3} does not support 'embed' request" in embed_to_llm.error, embed_to_llm.error
    finally:
        with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
            client.unload_model(V1_EMBEDDING)
