"""scripts/gpu_smoke.sh's checks, run here on the CPU engine (`--cpu`): the same code path users
run on a GPU host, minus CUDA (structured output included); its refusal to run without a GPU; and
an engine's refusal of structured output failing the structured-output checks with its words.
The engine section runs the shipped CPU config and model; the LoRA section by itself (`--only lora`),
on the shipped config with the demo model (`--model`) and two adapters constructed for it; models it cannot construct
adapters for skip its checks, saying why, and never pass. The image section runs the tiny LLaVA."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from triton_vllm_multistep.checks import (
    engines,
    gpu_smoke,
    images,
    lora,
    lora_reference,
    pbtxt,
    structured,
    v1_engine,
    v1_images,
)
from triton_vllm_multistep.checks import report as smoke_report

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_MODEL = ROOT / "model_repository" / "vllm_model"


def test_without_a_gpu_the_script_refuses_clearly() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "-1"}
    done = subprocess.run([ROOT / "scripts" / "gpu_smoke.sh"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no CUDA device: this script is for GPU hosts" in done.stderr


def test_config_parameters_are_read_as_tritons_parser_reads_them() -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for path in [SHIPPED_MODEL / "config.pbtxt", *(SHIPPED_MODEL / "configs").glob("*.pbtxt")]:
        message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        expected = {key: value.string_value for key, value in message.parameters.items()}
        assert pbtxt.pbtxt_string_parameters(path.read_text()) == expected
    text = """parameters [ { key: "a" value { string_value: 'x\\'y' } }, { key: 'b' value: { string_value: "" } } ]"""
    assert pbtxt.pbtxt_string_parameters(text) == {"a": "x'y", "b": ""}


def test_every_smoke_check_passes_on_the_cpu_engine_from_the_shipped_cpu_config(tmp_path: Path) -> None:
    """The engine section on the shipped CPU config and model (its JSON-schema request completes on a
    real model's answers; a random demo model runs out of tokens inside the object)."""
    engine_args, settings = engines.engine_args_from_config(SHIPPED_MODEL, SHIPPED_MODEL / "configs" / "cpu.pbtxt")
    assert engine_args.dtype == "float32" and settings.stream_mode == "step"
    report = gpu_smoke.run_smoke(engine_args, sections=("engine",))  # LoRA: its own test below
    assert [c.name for c in report.checks if not c.passed] == []
    assert len(report.checks) == 12
    structured = [c for c in report.checks if "structured output" in c.name]
    assert [c.name for c in structured] == [
        "structured output obeys its constraint (choice, JSON schema)",
        "structured output gives the tokens of num_scheduler_steps 1",
        "structured output streams one output per decoded step",
        "an unconstrained stream beside structured output streams the steps it has alone",
    ]
    assert "structured-choice: " in structured[0].detail and "finish stop" in structured[0].detail
    assert report.engine["engine"] == "CPUMultiStepEngine"
    assert report.engine["attention_backend"] == "TORCH_SDPA" and report.engine["num_scheduler_steps"] == 8
    assert not report.engine["cuda_graphs_requested"]


def test_an_engine_that_refuses_structured_output_fails_the_checks_with_its_refusal() -> None:
    """What the loop reports on an engine that refuses such requests (vLLM 0.8.5's add_request with
    num_scheduler_steps > 1 on GPU): a RequestFailed per constrained request; the beside stream runs."""
    refusal = "Guided decoding and logits processors are not supported in multi-step decoding"
    alone = [[7], [8], [9]]
    beside = smoke_report.Stream(deltas=alone, finished=True, finish_reason="length", steps={1, 2, 3})
    streams = {
        "structured-beside": beside,
        "structured-choice": smoke_report.Stream(failure=refusal),
        "structured-json": smoke_report.Stream(failure=refusal),
    }
    reference = {
        "structured-choice": smoke_report.Stream(deltas=[[3], [0]], text="no", finished=True, finish_reason="stop"),
        "structured-json": smoke_report.Stream(deltas=[[4]], text="{}", finished=True, finish_reason="stop"),
    }
    report = smoke_report.SmokeReport()
    structured.check_structured_output(report, streams, reference, alone)
    assert not report.passed and not any(check.passed for check in report.checks)
    assert all(refusal in check.detail for check in report.checks[:3])
    assert "steps shared with structured-choice 0" in report.checks[3].detail


def test_two_streams_are_the_same_only_if_both_ended_without_failure_with_equal_tokens() -> None:
    """The verdict the LoRA, structured-output and image sections give a stream against its reference."""
    tokens = smoke_report.Stream(deltas=[[1, 2], [3]], finished=True)
    assert tokens.same_tokens(smoke_report.Stream(deltas=[[1], [2, 3]], finished=True), 3)
    assert tokens.same_tokens(smoke_report.Stream(deltas=[[1, 2, 3]]))
    assert not tokens.same_tokens(smoke_report.Stream(deltas=[[1, 2, 3]]), 4)  # not the length asked for
    assert not tokens.same_tokens(smoke_report.Stream(deltas=[[1, 2, 4]]))
    assert not tokens.same_tokens(smoke_report.Stream(deltas=[[1, 2, 3]], failure="engine died"))
    failed = smoke_report.Stream(failure="refused")
    assert not failed.same_tokens(smoke_report.Stream(failure="refused"))  # two failures are not a match


def test_constrained_output_is_judged_by_its_constraint() -> None:
    def stream(text: str, finish_reason: str = "stop") -> smoke_report.Stream:
        return smoke_report.Stream(deltas=[[1]], text=text, finished=True, finish_reason=finish_reason)

    assert structured.obeys_constraint("structured-choice", stream("not sure"))
    assert not structured.obeys_constraint("structured-choice", stream("maybe"))
    assert structured.obeys_constraint("structured-json", stream('{"answer": "no", "certain": false}'))
    assert not structured.obeys_constraint("structured-json", stream('{"answer": "no"}'))  # a required key missing
    assert not structured.obeys_constraint("structured-json", stream('{"answer": "no", "cert', "length"))


def test_the_lora_checks_pass_on_their_own_with_two_adapters_constructed_for_the_model(tmp_path: Path) -> None:
    """`--only lora --cpu`: base + two adapters mixed in one batch = alone = num_scheduler_steps 1, the
    adapters change the answer, and = transformers with the adapter merged; the shipped config with the
    demo model (`--model`; SmolLM2 with its LoRA adapters served: e2e/test_lora_real_model.py)."""
    report_file = tmp_path / "report.json"
    model = ["--model-dir", str(SHIPPED_MODEL), "--model", "demo://tiny-llama-bpe"]
    code = gpu_smoke.main(["--cpu", "--only", "lora", *model, "--json", str(report_file)])
    report = json.loads(report_file.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert list(checks) == list(lora_reference.LORA_CHECKS)
    assert [name for name, check in checks.items() if not check["passed"] or check["skipped"]] == [], checks
    assert code == 0
    mixed, steps1, changed, merged = (checks[name]["detail"] for name in lora_reference.LORA_CHECKS)
    for request_id in ("lora-base", "lora-smoke-attention", "lora-smoke-mlp"):
        assert f"{request_id}: 12 tokens, equal alone=True" in mixed
        assert f"{request_id}: 12 tokens, equal=True" in steps1
        assert f"{request_id}: 12 tokens equal" in merged
    assert changed.count("changed=True") == 2
    assert report["engine"]["lora"]["max_loras"] == 2 and report["engine"]["lora"]["max_lora_rank"] == 8
    assert report["engine"]["num_scheduler_steps"] == 8 and "lora_transformers_seconds" in report["figures"]


def test_the_image_checks_pass_on_their_own_with_the_tiny_llava_demo_model(tmp_path: Path) -> None:
    """`--only image --cpu`: image and text requests in one batch = num_scheduler_steps 1 (engine
    process) = alone, and the image changes the answer."""
    report_file = tmp_path / "report.json"
    code = gpu_smoke.main(["--cpu", "--only", "image", "--model-dir", str(SHIPPED_MODEL), "--json", str(report_file)])
    report = json.loads(report_file.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert list(checks) == list(images.IMAGE_CHECKS)
    assert [name for name, check in checks.items() if not check["passed"] or check["skipped"]] == [], checks
    assert code == 0
    steps1, alone, _ = (checks[name]["detail"] for name in images.IMAGE_CHECKS)
    for request_id in ("image-red", "image-noise", "image-two", "image-text-only"):
        assert f"{request_id}: 12 tokens, finish length" in steps1 and steps1.count("equal=True") == 4
        assert f"{request_id}: 12 tokens" in alone and alone.count("equal=True") == 4
    assert "image_seconds" in report["figures"]


def test_the_v1_checks_pass_on_their_own_with_the_v1_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--only v1 --cpu`: the model as a `vllm_engine: v1` copy runs it (model.json without its
    multi-step settings), text prompts greedy and seeded in one batch, one output per step, each equal
    to V1's offline LLM; V1's CPU platform leaves async scheduling off when model.json does not ask; the
    tiny LLaVA model on V1 is the load error naming GPU hosts (its GPU branch needs a GPU).
    Eager and a 1 GiB KV cache: V1's CPU compile and its default 4 GiB cost a minute here."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    report_file = tmp_path / "report.json"
    model = [
        "--model-dir",
        str(SHIPPED_MODEL),
        "--model",
        "demo://tiny-llama-bpe",
        "--engine-args",
        '{"enforce_eager": true}',
    ]
    code = gpu_smoke.main(["--cpu", "--only", "v1", *model, "--json", str(report_file)])
    report = json.loads(report_file.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert [name for name, check in checks.items() if not check["passed"] or check["skipped"]] == [], checks
    equal = [name for name in checks if name.endswith("equals V1's offline LLM")]
    assert len(equal) == len(v1_engine.SAMPLINGS) * len(v1_engine.PROMPTS) and len(checks) == len(equal) + 4
    assert v1_images.CPU_REFUSAL in checks["v1 image model is a load error on CPU"]["detail"]  # GPU-only on V1
    assert code == 0
    assert report["engine"]["v1"]["async_scheduling"] is False and report["engine"]["v1"]["max_model_len"] == 2048
    assert "v1_seconds" in report["figures"]


def _lora_skips(model: str) -> smoke_report.SmokeReport:
    report = smoke_report.SmokeReport()
    lora.run_lora_checks(report, SimpleNamespace(model=model))
    return report


def test_the_lora_checks_are_skipped_with_the_reason_for_models_adapters_cannot_be_constructed_for(
    tmp_path: Path,
) -> None:
    """A hub id (no local folder) and a model whose config lacks the Llama fields: every LoRA check is
    reported skipped with the reason (not passed), and a report of skipped checks only does not pass."""
    gpt2 = tmp_path / "gpt2-like"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2}))
    for model, reason in [
        ("some-org/some-model", "has no local folder"),
        (str(gpt2), "not a Llama-style model (GPT2LMHeadModel): its config.json lacks hidden_size"),
    ]:
        report = _lora_skips(model)
        assert [c.name for c in report.checks] == list(lora_reference.LORA_CHECKS)
        assert all(c.skipped and not c.passed and reason in c.detail for c in report.checks), report.checks
        assert all("--lora-adapters name=path,name=path" in c.detail for c in report.checks)
        assert not report.passed and report.ran == []
    report = smoke_report.SmokeReport()
    report.check("ran", True, "")
    report.skip("could not run", "why")
    assert report.passed and [c.name for c in report.skipped] == ["could not run"]


def test_lora_adapters_option_names_each_folder(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    assert lora_reference.parse_lora_adapters(f"x={tmp_path / 'a'}, y={tmp_path / 'b'}") == [
        ("x", tmp_path / "a"),
        ("y", tmp_path / "b"),
    ]
    for text, message in [
        (f"x={tmp_path / 'a'},x={tmp_path / 'b'}", "given twice"),
        (str(tmp_path / "a"), "is not name=path"),
        (f"x={tmp_path}", "no adapter_config.json"),
        (",", "names no adapter"),
    ]:
        with pytest.raises(ValueError, match=message):
            lora_reference.parse_lora_adapters(text)
    with pytest.raises(SystemExit) as exited:
        gpu_smoke.main(["--cpu", "--lora-adapters", "nonsense"])
    assert exited.value.code == 2


def test_the_merged_reference_is_skipped_with_the_reason_when_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triton_vllm_multistep.checks import adapters as lora
    from triton_vllm_multistep.demo import models as demo_models

    model_dir = demo_models.build("tiny-llama-bpe")
    adapter = lora.write_adapter(model_dir, tmp_path / "plain", seed=1)
    assert lora_reference.no_constructed_adapters(str(model_dir), model_dir) is None
    assert lora_reference.no_merged_reference(model_dir, [("plain", adapter)], "auto") is None
    assert lora_reference.no_merged_reference(model_dir, [("plain", adapter)], "off") == "--lora-transformers off"
    assert "no local folder" in lora_reference.no_merged_reference(None, [("plain", adapter)], "on")
    dora = lora.write_adapter(model_dir, tmp_path / "dora", seed=2)
    (dora / "adapter_config.json").write_text(
        json.dumps({**json.loads((dora / "adapter_config.json").read_text()), "use_dora": True})
    )
    assert "adapter dora: use_dora" in lora_reference.no_merged_reference(model_dir, [("dora", dora)], "auto")
    monkeypatch.setattr(lora_reference, "TRANSFORMERS_MAX_PARAMS", 1000)
    assert "too large to run in transformers on the host" in lora_reference.no_merged_reference(
        model_dir, [("plain", adapter)], "auto"
    )
    assert lora_reference.no_merged_reference(model_dir, [("plain", adapter)], "on") is None


def test_the_merged_reference_is_exact_for_float32_and_allows_only_near_ties_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 engine must give transformers' greedy tokens; a bfloat16/float16 one may part from them
    only where its token is within NEAR_TIE_NATS of the merged model's best."""
    from triton_vllm_multistep.checks import adapters as lora
    from triton_vllm_multistep.demo import models as demo_models

    model_dir = demo_models.build("tiny-llama-bpe")
    adapter = lora.write_adapter(model_dir, tmp_path / "a", seed=1)
    prompt = list(engines.PROMPT)
    expected = lora.greedy_ids(lora.merged_model(model_dir, adapter), prompt, 6)
    assert lora_reference.merged_verdict(model_dir, adapter, prompt, expected, exact=True) == (True, "6 tokens equal")
    other = [*expected[:5], (expected[5] + 1) % 100]
    ok, detail = lora_reference.merged_verdict(model_dir, adapter, prompt, other, exact=True)
    assert not ok and detail.startswith("differ from token 5")
    monkeypatch.setattr(lora_reference, "NEAR_TIE_NATS", 1e9)
    ok, detail = lora_reference.merged_verdict(model_dir, adapter, prompt, other, exact=False)
    assert ok and "nats of the merged model's best" in detail
    monkeypatch.setattr(lora_reference, "NEAR_TIE_NATS", 0.0)
    assert not lora_reference.merged_verdict(model_dir, adapter, prompt, other, exact=False)[0]
