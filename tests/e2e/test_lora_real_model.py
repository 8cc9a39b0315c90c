"""The README's multi-LoRA example on the shipped model: its commands as written (a copy of the
repository, `enable_lora` turned on with sed), the demo adapters of the shipped multi_lora.json
(`pirate`, `shout`, trained locally by set-up) through the ensemble and the client example.

Each adapter visibly changes the answer, gives the same tokens at steps 8 as at steps 1, and the
same as transformers with the adapter merged into the weights (references.py, computed before the
server started). On the session's SmolLM2 LoRA server (conftest.py), shared with the other
real-model checks and the OpenAI checks. Owns the real-model LoRA checks; must not assert on timings.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from private_servers import REPO_ROOT, readme_client_command
from references import LORA_MAX_TOKENS, LORA_QUESTION, References, chat_ids
from served_models import LLM_MODEL, STEPS1
from transformers import AutoTokenizer
from triton_clients import grpc_generate

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.testing.local_server import ServerProcess

README = (REPO_ROOT / "README.md").read_text()
QUESTION = LORA_QUESTION


@pytest.fixture
def lora_real_server(smollm2_server: ServerProcess) -> ServerProcess:
    """The README's LoRA repository made by its commands, plus a single-step copy, loaded (conftest.py)."""
    return smollm2_server


def _answer(server: ServerProcess, ids: list[int], adapter: str | None, model: str = LLM_MODEL) -> list[int]:
    sampling = {"temperature": 0, "max_tokens": LORA_MAX_TOKENS, **({"lora_name": adapter} if adapter else {})}
    result = grpc_generate(server.grpc_url, model, input_ids=ids, sampling=sampling, stream=True)
    assert result.error is None and result.finals == 1, result.error
    return result.token_ids()


def test_the_readme_client_example_answers_like_a_pirate(lora_real_server: ServerProcess) -> None:
    argv = readme_client_command("--lora-name pirate")
    done = subprocess.run([*argv, "--url", lora_real_server.grpc_url], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("Arr"), done.stdout


@pytest.mark.parametrize("adapter", ["pirate", "shout"])
def test_each_demo_adapter_changes_the_answer_equals_steps_1_and_transformers_with_it_merged(
    lora_real_server: ServerProcess, references: References, adapter: str
) -> None:
    folder = Path(demo_models.resolve("demo://smollm2-135m-instruct")).resolve()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = chat_ids(tokenizer, QUESTION)
    base = _answer(lora_real_server, ids, None)
    tokens = _answer(lora_real_server, ids, adapter)
    assert tokens != base
    assert tokens == _answer(lora_real_server, ids, adapter, STEPS1)
    assert tokens == references.lora_merged[adapter]  # transformers, the adapter merged into the weights
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if adapter == "shout":
        letters = [c for c in text if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) >= 0.8 * len(letters), text
    else:
        assert text.startswith("Arr"), text
