"""What the served benchmark measures: the model, the prompts, the configurations and the targets.

Owns the constants every part shares and reading `targets.toml`; must not run anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

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


_TABLES = tomllib.loads((Path(__file__).with_name("targets.toml")).read_text())
CONFIGS: dict[str, Config] = {name: Config(name, **fields) for name, fields in _TABLES["configs"].items()}
TARGETS: dict[str, float] = {k: v for k, v in _TABLES["targets"].items() if k != "concurrency"}
TARGET_CONCURRENCY: int = _TABLES["targets"]["concurrency"]


def prompt(i: int) -> str:
    """Distinct prompts of similar length."""
    return f"request {i}: {PROMPTS[i % len(PROMPTS)]}"


def engine_json(steps: int, model: str) -> dict[str, Any]:
    """The served model's model.json with `num_scheduler_steps` and the model reference replaced."""
    data = json.loads((SOURCE_MODEL / "1" / "model.json").read_text())
    data["num_scheduler_steps"] = steps
    data["model"] = model
    return data
