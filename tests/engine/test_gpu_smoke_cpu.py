"""scripts/gpu_smoke.sh's checks, run here on the CPU engine (`--cpu`): the same code path users
run on a GPU host, minus CUDA; and its refusal to run without a GPU."""

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
    assert len(report.checks) == 8
    assert report.engine["engine"] == "CPUMultiStepEngine"
    assert report.engine["attention_backend"] == "TORCH_SDPA" and report.engine["num_scheduler_steps"] == 8
    assert not report.engine["cuda_graphs_requested"]
