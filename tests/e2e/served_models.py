"""Names of the models the session's server serves: the shipped repository plus test variants."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_REPOSITORY = REPO_ROOT / "model_repository"
LLM_MODEL = "vllm_model"
STEPS1 = "vllm_model_steps1"  # a single-step copy of the LLM model, on every server that has one
OPENAI_API_KEY = "test-key"  # smollm2_lora_server's --openai-api-key
REAL_MODEL = "demo://smollm2-135m-instruct"
# The shipped repository serves the real model; the tests' exactness checks run on the tiny demo
# model (fast, and far from greedy ties), so the test repository's pipeline uses it instead.
TINY_MODEL = "demo://tiny-llama-bpe"
# 2,048 KV-cache blocks (32K tokens, 128 MB on this model) instead of the 16,384 of 1 GiB: room for
# every test's batch, and a session's servers fit in memory beside each other on two xdist workers.
TINY_ENGINE = {"model": TINY_MODEL, "max_model_len": 1024, "num_gpu_blocks_override": 2048}
# Test variants of the shipped LLM model: name → model.json overrides.
LLM_VARIANTS = {
    "vllm_model_spm": {"model": "demo://tiny-llama-spm"},
    "vllm_model_steps1": {"num_scheduler_steps": 1},
    "vllm_model_window": {},  # per-window streaming, set in its config below
    # 24 KV blocks: a few streams fill it, the rest queue, growing ones are preempted (router metrics).
    "vllm_model_small_cache": {"max_model_len": 256, "num_gpu_blocks_override": 24},
    # Priority scheduling, two sequences at most: a third, more urgent request preempts one.
    "vllm_model_priority": {"scheduling_policy": "priority", "max_num_seqs": 2},
}
TOKENIZER_MODELS = {"bytelevel": LLM_MODEL, "metaspace": "vllm_model_spm"}
ENSEMBLES = {"bytelevel": "ensemble", "metaspace": "ensemble_spm"}
