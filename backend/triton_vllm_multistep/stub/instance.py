"""One model instance: config → engine + engine thread + response thread; Triton's entry points.

Owns wiring the pieces together and the Triton-facing lifecycle (auto-complete, initialize,
execute, finalize); must not parse inputs (codec) or drive the engine (engine/loop.py).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo.smollm2 import DemoModelError
from triton_vllm_multistep.engine import cpu_placement, extensions
from triton_vllm_multistep.engine.events import EngineRunner
from triton_vllm_multistep.engine.process import EngineProcess, EngineSpec, NoPythonForEngineProcess
from triton_vllm_multistep.lifecycle import drain, protocol, triton_command
from triton_vllm_multistep.stub import codec, config, lora, triton_io
from triton_vllm_multistep.stub.detokenization import window_decoder
from triton_vllm_multistep.stub.device import gpu_count, instance_device_environment

# Load errors caused by settings or set-up, not by a bug: their message is all a user needs.
SETTINGS_ERRORS = (config.ConfigError, DemoModelError)
logger = logging.getLogger("triton_vllm_multistep")
if not logger.handlers:  # the stub's stderr is Triton's log; say who is speaking
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

# (name, Triton type, dims, optional) for auto_complete_config; mirrors Triton's vLLM backend.
INPUTS = [
    ("text_input", "TYPE_STRING", [1], True),
    ("input_ids", "TYPE_INT32", [-1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    *((name, "TYPE_BOOL", [1], True) for name in codec.RETURN_FLAGS),
    # Declared as Triton's vLLM backend does (base64 images) so its clients' configs load; refused per request.
    (codec.IMAGE_INPUT, "TYPE_STRING", [-1], True),
]
# Triton's vLLM backend's words for a request refused by a failed engine, kept as the leading phrase.
UNHEALTHY_ENGINE_MESSAGE = "Model is unavailable due to unhealthy vLLM engine"
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("output_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("logprobs", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]),
    ("num_output_tokens", "TYPE_UINT32", [-1]),
    # For a stateless postprocessing model: ids to replay, and (context, start, end) in them.
    ("window_ids", "TYPE_INT32", [-1]),
    ("window_offsets", "TYPE_INT32", [3]),
]
INPUT_NAMES = [name for name, *_ in INPUTS]
OUTPUT_NAMES = [name for name, *_ in OUTPUTS]


def auto_complete(auto_config: Any) -> Any:
    """Fill in what config.pbtxt leaves out: decoupled policy, no batching, the tensors."""
    current = auto_config.as_dict()
    have_inputs = {i["name"] for i in current.get("input", [])}
    have_outputs = {o["name"] for o in current.get("output", [])}
    for name, dtype, dims, optional in INPUTS:
        if name not in have_inputs:
            auto_config.add_input({"name": name, "data_type": dtype, "dims": dims, "optional": optional})
    for name, dtype, dims in OUTPUTS:
        if name not in have_outputs:
            auto_config.add_output({"name": name, "data_type": dtype, "dims": dims})
    auto_config.set_max_batch_size(0)
    auto_config.set_model_transaction_policy({"decoupled": True})
    return auto_config


def launch_engine_process(settings: config.BackendSettings, model_name: str) -> EngineProcess | None:
    """Start the model's engine process now, if config.pbtxt `engine_process` asks (the default), so
    that it imports vLLM while the stub does; None: the engine runs in the stub.

    With the default (auto), a host where no Python can start that process gets the engine in the
    stub instead, with a warning saying what to set; an explicit `true` makes that a load error.
    Imports no vLLM (the caller may not have turned IPEX off yet otherwise).
    """
    if not settings.engine_process:
        return None
    process = EngineProcess()
    try:
        process.launch(settings.use_ipex, settings.engine_cpus)
    except NoPythonForEngineProcess as error:
        if settings.engine_process_required:
            asked = "engine_cpus is set" if settings.engine_cpus else "engine_process is true"
            raise config.ConfigError(f"model {model_name}: {asked} but {error}") from None
        logger.warning(
            "vllm_multistep: model %s: the engine runs in the stub (engine_process auto): %s", model_name, error
        )
        return None
    return process


def start_engine_runner(
    settings: config.BackendSettings,
    engine_values: dict[str, Any],
    engine_args: Any,
    user_threads: dict[str, str | None],
    process: EngineProcess | None,
    adapters: tuple[lora.Adapter, ...] = (),
) -> EngineRunner:
    """Build the model's engine in `process` (launched by launch_engine_process) or, without one, in
    a thread of the stub, with its LoRA `adapters` loaded once; returns its runner, built. Raises
    what the build raised (EngineBuildError for settings this backend refuses, or a bad adapter)."""
    from triton_vllm_multistep.engine.loop import serving_loop

    engine_mode = config.engine_stream_mode(settings.stream_mode)
    plain_adapters = tuple((a.name, a.lora_int_id, a.path) for a in adapters)
    if process is not None:
        process.spec = EngineSpec(
            engine_values,
            engine_mode,
            user_threads=user_threads,
            use_ipex=settings.use_ipex,
            cpus=settings.engine_cpus,
            lora_adapters=plain_adapters,
        )
        process.start_engine()
        return process
    runner = serving_loop(engine_args, engine_mode, user_threads, plain_adapters)
    runner.start_engine()  # a failed build has ended the engine thread
    return runner


def place_engine(
    cpus: tuple[int, ...], model_config: dict[str, Any], user_threads: dict[str, str | None], model_name: str
) -> None:
    """config.pbtxt `engine_cpus`: check it against the host and the user's thread settings (a load
    error naming both when they disagree), then move the stub's threads off the engine's CPUs (the
    engine process has moved onto them itself)."""
    instances = config.instance_count(model_config, gpu_count())
    if instances > 1:
        raise config.ConfigError(
            f"model {model_name}: engine_cpus places one engine, but instance_group runs {instances} instances "
            "of this model (each would put its engine on the same CPUs): use one instance, or leave engine_cpus out"
        )
    from vllm.platforms import current_platform

    try:
        cpu_placement.check_engine_cpus(cpus, user_threads, threads_bound=current_platform.is_cpu())
    except cpu_placement.CpuListError as error:
        raise config.ConfigError(f"model {model_name}: {error}") from None
    others = tuple(cpu for cpu in cpu_placement.allowed_cpus() if cpu not in cpus)
    if others:
        cpu_placement.pin_process(others)
    else:
        logger.warning(
            "vllm_multistep: model %s: engine_cpus %s hold every CPU the stub runs on: its threads share them",
            model_name,
            cpu_placement.cpu_list_text(cpus),
        )


class ModelServer:
    """Everything one Triton model instance runs."""

    def __init__(self, pb_utils: Any, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"])
        version = str(args.get("model_version", "1"))
        engine_json = lora.normalize_enable_lora(
            config.apply_config_engine_args(config.load_engine_json(model_dir, version), model_config)
        )
        if not config.use_ipex_setting(model_config, engine_json):
            from triton_vllm_multistep.engine.ipex_switch import turn_ipex_off

            turn_ipex_off()  # before the first vLLM import below
        self._pb = pb_utils
        # The one thread that calls into Triton: this one until the response thread starts, then it.
        self.caller = triton_io.TritonCaller()
        self.model_name = args.get("model_name") or model_config["name"]
        self._backend_name = model_config.get("backend") or "vllm_multistep"
        # Names the model in this stub and the engine process it starts (tools, extension modules).
        os.environ[extensions.MODEL_NAME_ENV] = self.model_name
        extensions.install_from_environment()  # test-only fault hooks, when the environment names them
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise config.ConfigError("model_transaction_policy { decoupled: true } is required: this backend streams")
        self.settings = config.backend_settings(model_config, engine_json)
        # The environment the engine runs with, set before the engine process starts (it inherits it).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.settings.cpu_kvcache_space_gib))
        os.environ.update(
            instance_device_environment(
                args.get("model_instance_kind", "CPU"),
                int(args.get("model_instance_device_id", 0)),
                config.parallel_size(engine_json),
            )
        )
        engine_process = launch_engine_process(self.settings, self.model_name)
        try:
            from triton_vllm_multistep.engine.factory import EngineBuildError, thread_choice_of_user

            engine_values = config.engine_args_values(engine_json, model_dir, self.settings)
            engine_args = config.to_engine_args(engine_values)
            self.adapters = lora.model_adapters(model_dir, version, engine_json, str(engine_values["model"]))
            # The stub is a child of tritonserver: its command line says how it runs.
            self._server_command = triton_command.of_process(os.getppid())
            user_threads = thread_choice_of_user()  # before the build: vLLM sets OMP_NUM_THREADS during it
            if self.settings.engine_cpus:
                place_engine(self.settings.engine_cpus, model_config, user_threads, self.model_name)
            try:
                self.loop: EngineRunner = start_engine_runner(
                    self.settings, engine_values, engine_args, user_threads, engine_process, self.adapters or ()
                )
            except EngineBuildError as error:
                # Settings this backend refuses: a load error naming them, not a trace into the engine.
                raise config.ConfigError(f"model {self.model_name}: {error}") from None
        except BaseException:
            if engine_process is not None:
                engine_process.stop()  # started early, never used (a refused setting, a failed build)
            raise
        from triton_vllm_multistep.stub.responder import Responder

        self.engine_in_process = engine_process is not None
        facts = self.loop.facts
        try:
            self._tokenizer = self._load_tokenizer(engine_args)
            tokenizer_vocab = getattr(self._tokenizer, "max_token_id", len(self._tokenizer) - 1) + 1
            self.limits = codec.ModelLimits(
                vocab_size=min(facts.vocab_size, tokenizer_vocab),
                max_model_len=facts.max_model_len,
                limits=self.settings.limits,
                model_name=facts.model,
                images_per_prompt=facts.images_per_prompt,
                adapters=self.adapters,
            )
            self.metrics = None
            if self.settings.enable_metrics:
                from triton_vllm_multistep.stub.metrics import BackendMetrics

                self.metrics = BackendMetrics(
                    pb_utils,
                    model_config["name"],
                    str(args.get("model_version", "1")),
                    facts.max_model_len,
                    instances=config.instance_count(model_config, gpu_count()),
                    caller=self.caller,
                    max_loras=facts.max_loras,
                )
            self.heartbeat = self._start_heartbeat(args)
            from triton_vllm_multistep.stub.restarts import RestartCount

            self.restart_count = self._instance_series(RestartCount, args)
            self.responder = Responder(
                pb_utils,
                abort=lambda rid: self.loop.abort(rid),
                observer=self.metrics,
                stream_interval=self.settings.stream_interval,
                merge_when_behind=self.settings.stream_mode == "merge",
                caller=self.caller,
            )
            self.responder.window_decode = window_decoder(self._load_tokenizer(engine_args))
            self.responder.after_engine_death = self._after_engine_death_answered
            if self.heartbeat is not None:
                self.responder.heartbeat = self.heartbeat.beat
            if self.metrics is not None:
                self.metrics.response_queue_depth = self.responder.queued_steps
            # Everything built so far (torch, vLLM, the model: ~10^6 objects) lives as long as the
            # model; without this, every full collection walks all of it (~250 ms with all threads
            # stopped) while serving. Frozen objects are never collected, so collect once first.
            gc.collect()
            gc.freeze()
            self.responder.start()
            self.loop.serve(
                sink=self.responder.post,
                on_state=self.metrics.update_engine_state if self.metrics else None,
                time_steps=self.metrics is not None,
            )
            self.drain = drain.unload_drain_for(
                self.model_name,
                str(args.get("model_version", "1")),
                self._server_command,
                self.settings.unload_drain_seconds,
                in_flight=self.responder.in_flight,
                close_intake=self.responder.close_intake,
                end_all=self.responder.end_all,
            )
            self.drain.start()
        except BaseException:
            self.loop.shutdown()
            raise
        logger.info(
            "vllm_multistep: model %s (%s) ready: num_scheduler_steps=%d, streaming per %s, torch threads %s, "
            "engine %s, attention kernels %s, drains for up to %.1f s on unload",
            self.model_name,
            facts.model,
            facts.num_scheduler_steps,
            {
                "step": "step",
                "window": "scheduling window",
                "merge": "step, several steps per response once sending would slow the engine",
            }[self.settings.stream_mode]
            + (f", every {self.settings.stream_interval} engine outputs" if self.settings.stream_interval > 1 else ""),
            self.loop.torch_threads,
            ("in a process of its own" if self.engine_in_process else "in the stub") + self._placement_text(),
            facts.attention_kernels,
            self.drain.drain_seconds,
        )

    def _start_heartbeat(self, args: dict[str, str]) -> Any:
        """The instance's heartbeat gauge (stub/heartbeat.py), or None where Triton has no metrics."""
        from triton_vllm_multistep.stub.heartbeat import Heartbeat

        return self._instance_series(Heartbeat, args)

    def _instance_series(self, kind: type, args: dict[str, str]) -> Any:
        """A metric series of this instance's own (labels model, version, instance), or None where
        Triton has no metrics."""
        instance = args.get("model_instance_name") or f"{self.model_name}_0"
        try:
            return kind(self._pb, self.model_name, str(args.get("model_version", "1")), instance, self.caller)
        except Exception as error:  # tritonserver --allow-metrics=false: no custom metrics at all
            logger.warning("vllm_multistep: model %s: no %s series (%s)", self.model_name, kind.__name__, error)
            return None

    def _placement_text(self) -> str:
        cpus = self.settings.engine_cpus
        return f" on CPUs {cpu_placement.cpu_list_text(cpus)}" if cpus else ""

    @staticmethod
    def _load_tokenizer(engine_args: Any) -> Any:
        """A tokenizer of our own for execute(): fast tokenizers are not safe to share across threads."""
        from vllm.transformers_utils.tokenizer import get_tokenizer

        return get_tokenizer(
            engine_args.tokenizer or engine_args.model,
            tokenizer_mode=engine_args.tokenizer_mode,
            trust_remote_code=engine_args.trust_remote_code,
            revision=engine_args.tokenizer_revision,
        )

    def execute(self, requests: list[Any]) -> None:
        """Validate and enqueue; responses come from the responder thread."""
        from triton_vllm_multistep.stub.responder import RequestState

        for request in requests:
            sender = request.get_response_sender()
            if self.responder.intake_closed is not None:
                self._refuse(sender)
                continue
            if not self.loop.healthy:
                self.responder.refuse(sender, self._unhealthy_message(), self._pb.TritonError.UNAVAILABLE)
                continue
            try:
                generation = codec.decode_request(
                    triton_io.input_arrays(self._pb, request, INPUT_NAMES),
                    request.parameters(),
                    self.limits,
                    encode=self._tokenizer.encode,
                    decode=self._tokenizer.decode,
                    outputs=triton_io.requested_outputs(request, OUTPUT_NAMES),
                )
            except codec.RequestError as error:
                self.responder.refuse(sender, str(error), self._pb.TritonError.INVALID_ARG)
                continue
            except Exception as error:
                logger.exception("unexpected error decoding a request")
                self.responder.refuse(sender, f"invalid request: {error}", self._pb.TritonError.INVALID_ARG)
                continue
            request_id = request.request_id() or ""
            engine_id = f"{request_id}-{uuid.uuid4().hex}" if request_id else uuid.uuid4().hex
            timing = None
            if self.metrics is not None:
                from triton_vllm_multistep.stub.metrics import RequestTiming

                timing = RequestTiming(
                    time.time(),
                    len(generation.prompt_token_ids),
                    generation.stream,
                    # With best_of > n, vLLM's SamplingParams keeps the client's n in _real_n.
                    n=generation.sampling_params._real_n or generation.sampling_params.n,
                )
            if not self.responder.register(engine_id, RequestState(sender=sender, request=generation, timing=timing)):
                self._refuse(sender)  # draining began since the check above
                continue
            # Plain values only (the adapter as (name, lora_int_id, path)): the engine builds vLLM's objects.
            self.loop.submit(codec.engine_request(generation, engine_id))
            if not self.loop.healthy:
                # The engine died between the check above and the submit: nobody else will
                # answer this request (fail() is a no-op if the death handling already did).
                self.responder.end(engine_id, self._unhealthy_message(), self._pb.TritonError.UNAVAILABLE)

    def _unhealthy_message(self) -> str:
        return f"{UNHEALTHY_ENGINE_MESSAGE}: {self.loop.error or 'the engine is not running'}"

    def _refuse(self, sender: Any) -> None:
        reason = self.responder.intake_closed
        self.responder.refuse(sender, f"{reason}: not taking new requests", self._pb.TritonError.UNAVAILABLE)

    def _after_engine_death_answered(self, message: str) -> None:
        """Response thread, once every request in flight has its error: take the model out of service.

        Made on the response thread itself, after the errors it has just sent, so the unload can
        never overlap a send, a cancellation check or a metrics update of this model (Triton 2.51's
        Python backend handles each of those on threads of its own, and releases a decoupled model
        once its last response factory is gone: docs/architecture.md, "One thread calls into
        Triton"). A client checking readiness the instant it gets its error can still find the
        model ready for a moment (docs/lifecycle.md).
        """
        if not self.settings.unload_on_engine_failure:
            logger.error(
                "vllm_multistep: model %s: engine failed (%s); answering UNAVAILABLE", self.model_name, message
            )
            return
        self._unload_self(message)

    def _unload_self(self, message: str) -> None:
        """Ask Triton to unload this model (explicit model control only), and log how it went.

        Python-based backends in Triton 2.51 cannot report "not ready" themselves (no `is_ready`
        hook): unloading is the only way to stop the model being reported ready. Triton's unload
        returns once started (its model lifecycle unloads asynchronously), so the response thread
        waits for no more than the request's round trip. Once asked, the response thread makes no
        optional call into Triton any more (heartbeat, metrics, cancellation checks): the model is
        going away, and only requests Triton still hands it get answers (UNAVAILABLE). In other
        model-control modes Triton refuses, and the model stays loaded answering UNAVAILABLE.
        """
        mode = self._server_command.model_control_mode if self._server_command else None
        try:
            # Triton refuses unloads outside explicit model control; a refused model-loader call takes
            # the 2.51 Python backend's error path for stub requests, the path that broke
            # is_model_ready during a server stop (see lifecycle/drain.py), so it is not made.
            if mode not in (None, "explicit"):
                raise RuntimeError(f"the server runs with --model-control-mode={mode}")
            self.caller.check("unloading the model")
            self.responder.quiesce()
            self._pb.unload_model(self.model_name)
        except Exception as error:
            logger.error(
                "vllm_multistep: engine of model %s failed (%s); could not unload it (%s): it stays loaded and "
                "answers UNAVAILABLE until the server is restarted (use --model-control-mode=explicit to have "
                "it unloaded)",
                self.model_name,
                message,
                error,
            )
        else:
            logger.error(
                "vllm_multistep: engine of model %s failed (%s); model unload requested", self.model_name, message
            )

    def _series_shared(self) -> bool:
        """Whether another stub may hold this instance's metric series now or while it closes: the
        model has other instances, or another stub of this model runs (a reload loads the new copy
        before it unloads the old). See BackendMetrics.close."""
        if self.metrics is not None and self.metrics.instances > 1:
            return True
        from triton_vllm_multistep.lifecycle import server_drain

        return any(
            pid != os.getpid() and server_drain.stub_model_name(pid) == self.model_name
            for pid in server_drain.backend_stub_pids(os.getppid(), self._backend_name)
        )

    def close(self) -> None:
        self.drain.stop()
        # The engine thread ends by releasing remote (tensor-parallel) workers from their execution
        # loop: a worker still in it never reads the executor's shutdown request.
        self.loop.stop()
        self.responder.stop(protocol.UNLOADING_MESSAGE)  # hands the calls into Triton back to this thread
        for series in (self.heartbeat, self.restart_count):  # their instance label is this stub's own: never shared
            if series is None:
                continue
            try:
                series.close()
            except Exception:
                logger.exception("closing %s failed", type(series).__name__)
        if self.metrics is not None:
            try:
                self.metrics.close(shared=self._series_shared())
            except Exception:
                logger.exception("closing the metrics failed")
        self.loop.shutdown()
        logger.info("vllm_multistep: model %s finalized: engine shut down", self.model_name)
