"""scripts/gpu_smoke.sh's checks, run here on the CPU engine (`--cpu`): the same code path users
run on a GPU host, minus CUDA (structured output included); its refusal to run without a GPU; and
an engine's refusal of structured output failing the structured-output checks with its words."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from triton_vllm_multistep.testing import gpu_smoke

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
        assert gpu_smoke.pbtxt_string_parameters(path.read_text()) == expected
    text = """parameters [ { key: "a" value { string_value: 'x\\'y' } }, { key: 'b' value: { string_value: "" } } ]"""
    assert gpu_smoke.pbtxt_string_parameters(text) == {"a": "x'y", "b": ""}


def test_every_smoke_check_passes_on_the_cpu_engine_from_the_shipped_cpu_config(tmp_path: Path) -> None:
    engine_args, settings = gpu_smoke.engine_args_from_config(SHIPPED_MODEL, SHIPPED_MODEL / "configs" / "cpu.pbtxt")
    assert engine_args.dtype == "float32" and settings.stream_mode == "step"
    report = gpu_smoke.run_smoke(engine_args)
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
    beside = gpu_smoke.Stream(deltas=alone, finished=True, finish_reason="length", steps={1, 2, 3})
    streams = {
        "structured-beside": beside,
        "structured-choice": gpu_smoke.Stream(failure=refusal),
        "structured-json": gpu_smoke.Stream(failure=refusal),
    }
    reference = {
        "structured-choice": gpu_smoke.Stream(deltas=[[3], [0]], text="no", finished=True, finish_reason="stop"),
        "structured-json": gpu_smoke.Stream(deltas=[[4]], text="{}", finished=True, finish_reason="stop"),
    }
    report = gpu_smoke.SmokeReport()
    gpu_smoke.check_structured_output(report, streams, reference, alone)
    assert not report.passed and not any(check.passed for check in report.checks)
    assert all(refusal in check.detail for check in report.checks[:3])
    assert "steps shared with structured-choice 0" in report.checks[3].detail


def test_constrained_output_is_judged_by_its_constraint() -> None:
    def stream(text: str, finish_reason: str = "stop") -> gpu_smoke.Stream:
        return gpu_smoke.Stream(deltas=[[1]], text=text, finished=True, finish_reason=finish_reason)

    assert gpu_smoke.obeys_constraint("structured-choice", stream("not sure"))
    assert not gpu_smoke.obeys_constraint("structured-choice", stream("maybe"))
    assert gpu_smoke.obeys_constraint("structured-json", stream('{"answer": "no", "certain": false}'))
    assert not gpu_smoke.obeys_constraint("structured-json", stream('{"answer": "no"}'))  # a required key missing
    assert not gpu_smoke.obeys_constraint("structured-json", stream('{"answer": "no", "cert', "length"))
