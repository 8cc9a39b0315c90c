"""What the served benchmark measures: the model, the prompts, the configurations and the targets.

Owns the constants every part shares and reading `targets.toml`; must not run anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

if TYPE_CHECKING:
    from triton_vllm_multistep.settings import ModelSettings

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
SOURCE_MODEL = ROOT / "model_repository" / "vllm_model"  # its config.pbtxt and model.json are the base
MODEL = "vllm_model"  # the served model's name
DEFAULT_MODEL_REFERENCE = "demo://tiny-llama-bpe"
KV_CACHE_GIB = "1"
PROMPTS = (
    "the model streams every token of a response while the engine schedules",
    "cats sleep near warm windows and rivers run to the sea",
    "people write code read books and drink coffee in small cafes",
    "a quick brown fox jumps over lazy dogs under bright stars",
)


@dataclass(frozen=True)
class Config:
    """One served configuration."""

    name: str
    label: str
    num_scheduler_steps: int
    stream_mode: str
    engine: dict[str, Any] = field(default_factory=dict)  # model.json fields on top of the shipped ones
    prefix_run: bool = False  # measured by the shared-prefix run (--shared-prefix), not the main one
    parameters: dict[str, str] = field(default_factory=dict)  # config.pbtxt parameters besides stream_mode
    in_default_run: bool = True  # false: measured only when named with --configs
    # "backend" (this project) or a peer users would run instead (benchmarks/served/peers.py).
    server: str = "backend"
    # The outputs the client asks for (None: all, as a client that names none gets).
    client_outputs: list[str] | None = None
    # Environment variables the server starts with (its stubs and engine processes inherit them).
    environment: dict[str, str] = field(default_factory=dict)


_TABLES = tomllib.loads((Path(__file__).with_name("targets.toml")).read_text())
CONFIGS: dict[str, Config] = {name: Config(name, **fields) for name, fields in _TABLES["configs"].items()}
TARGETS: dict[str, float] = {k: v for k, v in _TABLES["targets"].items() if k != "concurrency"}
TARGET_CONCURRENCY: int = _TABLES["targets"]["concurrency"]


# What every prompt starts with in the shared-prefix run (a chat template's system prompt); empty otherwise.
SHARED_PREFIX = {"text": ""}


def shared_system_prompt(words: int) -> str:
    """A system prompt of about `words` words, the same for every request (its token count is measured)."""
    sentence = "you are a careful assistant who answers briefly and politely in plain words "
    count = max(1, words // len(sentence.split()))
    return "system: " + sentence * count + "\nuser: "


def prompt(i: int) -> str:
    """Distinct prompts of similar length (after the shared prefix, in the shared-prefix run)."""
    return f"{SHARED_PREFIX['text']}request {i}: {PROMPTS[i % len(PROMPTS)]}"


def served_model_settings(steps: int, model: str) -> ModelSettings:
    """The served model's settings on CPU (model.json + configs/cpu.pbtxt, read as its stub reads
    them: settings/), with `num_scheduler_steps` and the model reference replaced: the offline
    engine runs what the server runs."""
    from triton_vllm_multistep.checks.pbtxt import pbtxt_string_parameters
    from triton_vllm_multistep.settings import config_with_parameters, read_model_settings

    parameters = pbtxt_string_parameters((SOURCE_MODEL / "configs" / "cpu.pbtxt").read_text())
    overrides = {"num_scheduler_steps": steps, "model": model}
    return read_model_settings(SOURCE_MODEL, "1", config_with_parameters(parameters), overrides=overrides)


def engine_json(steps: int, model: str) -> dict[str, Any]:
    """The served model's engine arguments as model.json + the CPU config's engine_args give them
    (before the backend's defaults and path resolution), at `steps` and with `model`."""
    return dict(served_model_settings(steps, model).engine_json)
