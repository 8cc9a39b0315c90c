"""The GPU engine path with vLLM's CUDA platform simulated (compute capability 9.0 unless said).

Builds the engine config of every shipped GPU config through the backend's own path (model.json +
the config's engine_args → settings/ → engine.factory.build_engine, stopped just before vLLM
builds workers) and runs vLLM 0.8.5's own attention-backend choice and MultiStepModelRunner check
on it; shows that what the backend refuses at load is what vLLM's runner would refuse later. No
GPU here: this proves configuration decisions only, not kernels (see docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from pathlib import Path
from typing import Any

os.environ["VLLM_USE_V1"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
from simulated_cuda import simulated_cuda
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from triton_vllm_multistep.engine import factory, gpu_worker
from triton_vllm_multistep.engine.engine_args import engine_args_of
from triton_vllm_multistep.engine.factory import EngineBuildError, build_engine
from triton_vllm_multistep.engine.gpu_multistep import WindowClosingEngine, chosen_attention_backend
from triton_vllm_multistep.engine.loop import module_hooks_time_the_forward_pass
from triton_vllm_multistep.settings import BackendSettings, ConfigError, read_model_settings

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def _model_config(path: Path) -> dict[str, Any]:
    """A config.pbtxt as Triton hands it to the backend (args['model_config'] is this, as JSON)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def shipped_gpu_configs(embedding: bool = False) -> list[Path]:
    """config.pbtxt files of this backend's models that are not CPU-only (KIND_CPU everywhere): the
    generative ones, or with `embedding` the embedding models' (model.json task "embed")."""
    found = []
    for model_dir in sorted(p for p in REPOSITORY.iterdir() if p.is_dir()):
        engine_json = model_dir / "1" / "model.json"
        task = json.loads(engine_json.read_text()).get("task") if engine_json.is_file() else None
        if (task == "embed") != embedding:
            continue
        for path in [model_dir / "config.pbtxt", *sorted((model_dir / "configs").glob("*.pbtxt"))]:
            if not path.exists():
                continue
            model_config = _model_config(path)
            kinds = {group.get("kind", "KIND_AUTO") for group in model_config.get("instance_group", [])}
            if model_config.get("backend") == "vllm_multistep" and kinds != {"KIND_CPU"}:
                found.append(path)
    return found


def _engine_args(path: Path, overrides: dict[str, Any] | None = None) -> tuple[EngineArgs, BackendSettings]:
    """What ModelServer.__init__ derives from a config file: model.json + engine_args, settings."""
    model_config = _model_config(path)
    if overrides is not None:
        parameters = model_config.setdefault("parameters", {})
        current = json.loads(parameters.get("engine_args", {}).get("string_value", "{}") or "{}")
        parameters["engine_args"] = {"string_value": json.dumps({**current, **overrides})}
    model_dir = path.parent if path.parent.name != "configs" else path.parent.parent
    settings = read_model_settings(model_dir, "1", model_config)
    return engine_args_of(settings), settings.backend


def _build_config(monkeypatch: pytest.MonkeyPatch, args: EngineArgs, stream_mode: str = "step") -> VllmConfig:
    """build_engine up to the point where vLLM would start building workers; the config it built."""
    built: list[VllmConfig] = []

    def capture(cls: type, vllm_config: VllmConfig, **_: Any) -> Any:
        assert cls is WindowClosingEngine
        built.append(vllm_config)
        # What build_engine reads of the engine afterwards (no workers are built here).
        return types.SimpleNamespace(scheduler=[], model_config=vllm_config.model_config)

    monkeypatch.setattr(WindowClosingEngine, "from_vllm_config", classmethod(capture))
    build_engine(args, stream_mode=stream_mode)
    (vllm_config,) = built
    return vllm_config


def _vllm_multi_step_runner(vllm_config: VllmConfig) -> None:
    """vLLM's own check, as MultiStepWorker.__init__ calls it (raises ValueError if it refuses)."""
    from vllm.worker.multi_step_model_runner import MultiStepModelRunner

    MultiStepModelRunner(
        None, vllm_config=vllm_config, kv_cache_dtype=vllm_config.cache_config.cache_dtype, is_driver_worker=True
    )


def _small(args: EngineArgs, **changes: Any) -> EngineArgs:
    return dataclasses.replace(args, max_model_len=256, **changes)


def test_the_repository_ships_a_gpu_config() -> None:
    assert REPOSITORY / "vllm_model" / "config.pbtxt" in shipped_gpu_configs()


@pytest.mark.parametrize("path", shipped_gpu_configs(), ids=lambda p: str(p.relative_to(REPOSITORY)))
def test_every_shipped_gpu_config_gets_an_engine_config_vllms_multi_step_runner_accepts(
    monkeypatch: pytest.MonkeyPatch, path: Path
) -> None:
    args, settings = _engine_args(path)
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, args, settings.stream_mode)
        assert vllm_config.device_config.device.type == "cuda"
        scheduler = vllm_config.scheduler_config
        assert scheduler.is_multi_step and scheduler.num_scheduler_steps == args.num_scheduler_steps > 1
        assert scheduler.multi_step_stream_outputs is (settings.stream_mode == "step")
        assert not scheduler.chunked_prefill_enabled
        assert vllm_config.parallel_config.worker_cls == gpu_worker.WORKER_QUALNAME
        assert chosen_attention_backend(vllm_config) in ("FLASH_ATTN", "FLASHINFER")
        _vllm_multi_step_runner(vllm_config)  # accepted: no ValueError


@pytest.mark.parametrize("path", shipped_gpu_configs(embedding=True), ids=lambda p: str(p.relative_to(REPOSITORY)))
def test_every_shipped_embedding_gpu_config_builds_vllms_own_one_step_pooling_engine(
    monkeypatch: pytest.MonkeyPatch, path: Path
) -> None:
    """An embedding model on GPU: vLLM's own engine at one step (no multi-step worker or scheduler of
    ours), its pooling model runner, vLLM's GPU dtype choice."""
    args, _ = _engine_args(path)
    assert args.task == "embed" and args.num_scheduler_steps == 1
    built: list[EngineArgs] = []
    monkeypatch.setattr(
        factory.LLMEngine,
        "from_engine_args",
        classmethod(lambda cls, engine_args, **_: built.append(engine_args) or types.SimpleNamespace(scheduler=[])),
    )
    with simulated_cuda():
        factory._build_engine(args, "step")
        (sent,) = built
        vllm_config = sent.create_engine_config()
        assert vllm_config.device_config.device.type == "cuda" and vllm_config.model_config.runner_type == "pooling"
        assert vllm_config.scheduler_config.num_scheduler_steps == 1 and not vllm_config.scheduler_config.is_multi_step
        assert vllm_config.parallel_config.worker_cls == "vllm.worker.worker.Worker"
        assert str(vllm_config.model_config.dtype) == "torch.float16"


def test_float32_is_refused_at_load_naming_the_setting_and_vllm_would_refuse_it_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt", {"dtype": "float32"})
    assert args.dtype == "float32"
    with simulated_cuda():
        with pytest.raises(EngineBuildError) as refused:
            _build_config(monkeypatch, args)
        message = str(refused.value)
        assert "dtype float32" in message and "XFORMERS" in message
        assert "set the engine argument dtype to bfloat16 or float16" in message
        # Without the backend's check vLLM builds this config, then its runner refuses it.
        unchecked = dataclasses.replace(args).create_engine_config()
        assert chosen_attention_backend(unchecked) == "XFORMERS"
        with pytest.raises(ValueError, match="Multi-Step not supported for attention backend: XFORMERS"):
            _vllm_multi_step_runner(unchecked)


def test_auto_dtype_of_a_float32_checkpoint_becomes_float16_and_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt", {"dtype": "auto"})
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, _small(args))
        assert str(vllm_config.model_config.dtype) == "torch.float16"  # vLLM's CUDA rule for fp32 checkpoints
        assert chosen_attention_backend(vllm_config) == "FLASH_ATTN"
        _vllm_multi_step_runner(vllm_config)


def test_prefix_caching_with_multi_step_is_accepted_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt", {"enable_prefix_caching": True})
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, _small(args))
        assert vllm_config.cache_config.enable_prefix_caching
        assert vllm_config.scheduler_config.is_multi_step
        _vllm_multi_step_runner(vllm_config)


def test_a_gpu_without_flash_attention_is_refused_naming_its_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    with simulated_cuda(capability=(7, 5)):
        with pytest.raises(EngineBuildError, match=r"compute capability 7\.5.*set num_scheduler_steps to 1"):
            _build_config(monkeypatch, _small(args))
        with pytest.raises(ValueError, match="XFORMERS"):
            _vllm_multi_step_runner(dataclasses.replace(_small(args)).create_engine_config())


def test_an_attention_backend_forced_by_the_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    with simulated_cuda():
        monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "XFORMERS")
        with pytest.raises(EngineBuildError, match="VLLM_ATTENTION_BACKEND=XFORMERS selects XFORMERS.*unset it"):
            _build_config(monkeypatch, _small(args))


def test_pipeline_parallel_is_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt", {"pipeline_parallel_size": 2})
    monkeypatch.setattr(factory, "preload_model_classes", lambda _args: pytest.fail("reached the build"))
    with simulated_cuda():
        with pytest.raises(EngineBuildError, match="pipeline_parallel_size=2.*set pipeline_parallel_size to 1"):
            build_engine(args)
    with pytest.raises(EngineBuildError, match="pipeline_parallel_size=2"):
        build_engine(args)  # CPU too, and with one step (vLLM's step() is the same)
    with pytest.raises(EngineBuildError, match="pipeline_parallel_size=2"):
        build_engine(dataclasses.replace(args, num_scheduler_steps=1))


def test_tensor_parallel_configs_still_build_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # The shipped model (SmolLM2-135M: 9 attention heads, 3 KV heads) splits over 3 GPUs.
    args, _ = _engine_args(
        REPOSITORY / "vllm_model" / "config.pbtxt", {"tensor_parallel_size": 3, "distributed_executor_backend": "mp"}
    )
    with simulated_cuda():
        vllm_config = _build_config(monkeypatch, _small(args))
        assert vllm_config.parallel_config.tensor_parallel_size == 3
        assert vllm_config.parallel_config.worker_cls == gpu_worker.WORKER_QUALNAME


def test_forward_pass_hooks_are_used_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _engine_args(REPOSITORY / "vllm_model" / "config.pbtxt")
    with simulated_cuda():
        gpu_config = _build_config(monkeypatch, _small(args))
    assert not module_hooks_time_the_forward_pass(types.SimpleNamespace(device_config=gpu_config.device_config))
    cpu_config = factory.cpu_multistep_config(_small(args, dtype="float32"), stream_mode="step")
    assert module_hooks_time_the_forward_pass(types.SimpleNamespace(device_config=cpu_config.device_config))


def test_engine_cpus_leaves_the_users_thread_count_alone_on_cuda_only() -> None:
    """On a GPU host vLLM binds no threads for engine_cpus (only its CPU worker reads
    VLLM_CPU_OMP_THREADS_BIND), so an OMP_NUM_THREADS of the user's is not a disagreement there; on
    CPU it is a load error naming both. All the CPUs: nothing of this process is moved."""
    from triton_vllm_multistep.engine import cpu_placement
    from triton_vllm_multistep.stub import instance

    cpus = cpu_placement.allowed_cpus()
    one_instance = {"instance_group": [{"kind": "KIND_MODEL", "count": 1}]}
    user_threads = {"OMP_NUM_THREADS": "64"}
    with simulated_cuda():
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()  # vLLM's answer; the stub's device-node one agrees (below)
    assert on_cpu is False
    instance.place_engine(cpus, one_instance, user_threads, "llm", engine_on_cpu=on_cpu)
    with pytest.raises(ConfigError, match="but OMP_NUM_THREADS=64"):
        instance.place_engine(cpus, one_instance, user_threads, "llm", engine_on_cpu=True)
    assert set(cpu_placement.thread_cpus(os.getpid()).values()) == {cpus}


def test_engine_cpus_of_an_engine_process_leaves_the_users_thread_count_alone_on_gpu_hosts_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stub's branch of the same decision for an engine process, either engine's (the stub imports
    no vLLM; vLLM 0.32 cannot even be imported there: the host's GPU device nodes decide,
    stub/device.py): with /dev showing an NVIDIA GPU the user's OMP_NUM_THREADS stands; without, it
    is a load error naming both, as vLLM's CPU worker would bind one thread per engine_cpus CPU
    whatever it says."""
    import functools

    from triton_vllm_multistep.engine import cpu_placement
    from triton_vllm_multistep.stub import device, instance

    cpus = cpu_placement.allowed_cpus()
    one_instance = {"instance_group": [{"kind": "KIND_MODEL", "count": 1}]}
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TRITON_VLLM_MULTISTEP_DEVICE", raising=False)
    gpu_dev = tmp_path / "dev"
    gpu_dev.mkdir()
    (gpu_dev / "nvidia0").touch()
    (gpu_dev / "nvidiactl").touch()  # not a GPU
    monkeypatch.setattr(instance, "gpu_count", functools.partial(device.gpu_count, dev=gpu_dev))
    instance.place_engine_process(cpus, one_instance, "llm_v1")
    monkeypatch.setattr(instance, "gpu_count", functools.partial(device.gpu_count, dev=tmp_path))
    with pytest.raises(ConfigError, match="but OMP_NUM_THREADS=64 in the server's environment"):
        instance.place_engine_process(cpus, one_instance, "llm_v1")
    assert set(cpu_placement.thread_cpus(os.getpid()).values()) == {cpus}
