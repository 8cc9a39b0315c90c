"""A `vllm_engine: v1` model through the real server: vLLM's current engine (.venv-v1) behind the
same tensors, streaming one response per decoded step with exactly the tokens of the V1 engine's
own offline LLM (greedy and seeded), streamed = whole; what V1 removed is refused for that request
alone; multi-step settings on a V1 model fail its load naming both.

Owns the served V1 checks on a server of its own (the tiny demo model; the engine-process seam is
tests/engine/test_v1_engine_process.py's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from private_servers import make_repository, model_ready, serving
from served_models import TINY_ENGINE
from triton_clients import grpc_generate

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.host.launcher import v1_environment_python
from triton_vllm_multistep.testing.local_server import ServerProcess
from triton_vllm_multistep.testing.v1_reference import offline_v1_tokens

V1 = "llm_v1"
V1_WITH_STEPS = "llm_v1_with_steps"
V1_ENGINE = {"num_scheduler_steps": None, "enforce_eager": True}
TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": TOKENS, "ignore_eos": True}
PROMPTS = ((1, 5, 9, 12, 40), (3, 4, 5), (7, 8, 2, 2, 6, 100, 3))


@pytest.fixture(scope="module")
def v1_server(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> Iterator[ServerProcess]:
    root: Path = tmp_path_factory.mktemp("v1_served")
    repository = make_repository(
        root,
        {
            V1: {"engine": V1_ENGINE, "parameters": {"vllm_engine": "v1"}},
            V1_WITH_STEPS: {"engine": {"enforce_eager": True}, "parameters": {"vllm_engine": "v1"}},
        },
    )
    with serving(
        repository, root / "tritonserver.log", "--model-control-mode=explicit", f"--load-model={V1}"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def offline(demo_model_paths: dict) -> dict[str, list[int]]:
    python = v1_environment_python()
    assert python is not None, "scripts/setup.sh builds .venv-v1"
    # As served: the CPU config's engine_args (float32) and the shipped model.json's seed.
    fields = {
        **TINY_ENGINE,
        **V1_ENGINE,
        "model": str(demo_models.build("tiny-llama-bpe")),
        "seed": 0,
        "dtype": "float32",
    }
    fields = {key: value for key, value in fields.items() if value is not None}
    requests = [(f"{kind}-{i}", ids, sampling) for kind, sampling in (("greedy", GREEDY), ("seeded", SEEDED))
                for i, ids in enumerate(PROMPTS)]  # fmt: skip
    return offline_v1_tokens(python, fields, requests)


@pytest.mark.parametrize(("kind", "sampling"), [("greedy", GREEDY), ("seeded", SEEDED)])
def test_v1_streams_one_response_per_step_with_its_offline_tokens_and_whole_equals_streamed(
    v1_server: ServerProcess, offline: dict[str, list[int]], kind: str, sampling: dict
) -> None:
    for i, ids in enumerate(PROMPTS):
        streamed = grpc_generate(v1_server.grpc_url, V1, input_ids=list(ids), sampling=sampling, stream=True)
        assert streamed.error is None and streamed.finals == 1, streamed.error
        assert streamed.token_ids() == offline[f"{kind}-{i}"]
        assert [len(r["output_ids"]) for r in streamed.data_responses] == [1] * TOKENS  # one per step
        whole = grpc_generate(v1_server.grpc_url, V1, input_ids=list(ids), sampling=sampling, stream=False)
        assert whole.error is None and whole.token_ids() == streamed.token_ids()
        assert whole.text() == streamed.text()


def test_a_field_v1_removed_fails_that_request_alone_naming_it(v1_server: ServerProcess) -> None:
    refused = grpc_generate(v1_server.grpc_url, V1, input_ids=[1, 2, 3], sampling={**SEEDED, "best_of": 3})
    assert refused.error is not None and "vLLM's V1 engine removed best_of" in refused.error
    after = grpc_generate(v1_server.grpc_url, V1, input_ids=[1, 2, 3], sampling=GREEDY, stream=True)
    assert after.error is None and len(after.token_ids()) == TOKENS


def test_num_scheduler_steps_on_a_v1_model_fails_its_load_naming_both(v1_server: ServerProcess) -> None:
    with grpcclient.InferenceServerClient(v1_server.grpc_url) as client:
        with pytest.raises(Exception, match="'vllm_engine'='v1' and model.json 'num_scheduler_steps'=8 disagree"):
            client.load_model(V1_WITH_STEPS)
    assert model_ready(v1_server, V1) and not model_ready(v1_server, V1_WITH_STEPS)
