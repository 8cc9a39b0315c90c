"""One model instance: settings → engine + engine thread + response thread; Triton's entry points.

Owns wiring the pieces together and the Triton-facing lifecycle (auto-complete, initialize,
execute, finalize); must not read settings (settings/), parse inputs (codec) or drive the engine
(engine/loop.py).
"""

from __future__ import annotations

import gc
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from triton_vllm_multistep.demo.smollm2 import DemoModelError
from triton_vllm_multistep.engine import cpu_placement, extensions
from triton_vllm_multistep.engine.engine_args import engine_values, to_engine_args
from triton_vllm_multistep.engine.events import EngineBuildError, EngineRunner, token_ids_of
from triton_vllm_multistep.engine.process import EngineProcess, EngineProcessError, EngineSpec, NoPythonForEngineProcess
from triton_vllm_multistep.interface import INPUT_NAMES, INPUTS, OUTPUT_NAMES, OUTPUTS, UNHEALTHY_ENGINE_MESSAGE
from triton_vllm_multistep.lifecycle import drain, protocol, triton_command
from triton_vllm_multistep.logs import log_package_to_stderr
from triton_vllm_multistep.settings import Adapter, BackendSettings, ConfigError, ModelSettings, read_model_settings
from triton_vllm_multistep.settings.backend import engine_stream_mode, instance_count
from triton_vllm_multistep.stub import codec, triton_io
from triton_vllm_multistep.stub.detokenization import window_decoder
from triton_vllm_multistep.stub.device import gpu_count, instance_device_environment
from triton_vllm_multistep.stub.model_tokenizer import TokenizerSource, load_tokenizer

# Load errors caused by settings or set-up, not by a bug: their message is all a user needs.
SETTINGS_ERRORS = (ConfigError, DemoModelError)
logger = log_package_to_stderr()  # the stub's stderr is Triton's log; say who is speaking


def auto_complete(auto_config: Any) -> Any:
    """Fill in what config.pbtxt leaves out: decoupled policy, no batching, the tensors."""
    current = auto_config.as_dict()
    have_inputs = {i["name"] for i in current.get("input", [])}
    have_outputs = {o["name"] for o in current.get("output", [])}
    for tensor in INPUTS:
        if tensor.name not in have_inputs:
            auto_config.add_input(tensor.input_config())
    for tensor in OUTPUTS:
        if tensor.name not in have_outputs:
            auto_config.add_output(tensor.output_config())
    auto_config.set_max_batch_size(0)
    auto_config.set_model_transaction_policy({"decoupled": True})
    return auto_config


def launch_engine_process(settings: BackendSettings, model_name: str) -> EngineProcess | None:
    """Start the model's engine process now, if config.pbtxt `engine_process` asks (the default), so
    that it imports vLLM while the stub does; None: the engine runs in the stub.

    With the default (auto), a host where no Python can start that process gets the engine in the
    stub instead, with a warning saying what to set; an explicit `true` makes that a load error.
    Imports no vLLM (the caller may not have turned IPEX off yet otherwise).
    """
    if not settings.engine_process:
        return None
    v1 = settings.vllm_engine == "v1"
    process = EngineProcess(v1=v1)
    try:
        process.launch(settings.use_ipex, settings.engine_cpus)
    except NoPythonForEngineProcess as error:
        if v1:
            raise ConfigError(f"model {model_name}: vllm_engine is 'v1' but {error}") from None
        if settings.engine_process_required:
            asked = "engine_cpus is set" if settings.engine_cpus else "engine_process is true"
            raise ConfigError(f"model {model_name}: {asked} but {error}") from None
        logger.warning(
            "vllm_multistep: model %s: the engine runs in the stub (engine_process auto): %s", model_name, error
        )
        return None
    return process


def start_engine_runner(
    settings: BackendSettings,
    engine_values: dict[str, Any],
    engine_args: Any,
    user_threads: dict[str, str | None],
    process: EngineProcess | None,
    adapters: tuple[Adapter, ...] = (),
) -> EngineRunner:
    """Build the model's engine in `process` (launched by launch_engine_process; it checks
    `engine_values` against its vLLM and builds the EngineArgs itself) or, without one, in a thread
    of the stub (from `engine_args`, built here), with its LoRA `adapters` loaded once; returns its
    runner, built. Raises what the build raised (a ConfigError for model.json fields vLLM refuses,
    EngineBuildError for settings this backend refuses, or a bad adapter)."""
    engine_mode = engine_stream_mode(settings.stream_mode)
    plain_adapters = tuple(adapter.engine_value() for adapter in adapters)
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
    from triton_vllm_multistep.engine.loop import serving_loop

    runner = serving_loop(engine_args, engine_mode, user_threads, plain_adapters)
    runner.start_engine()  # a failed build has ended the engine thread
    return runner


def place_engine(
    cpus: tuple[int, ...],
    model_config: dict[str, Any],
    user_threads: dict[str, str | None],
    model_name: str,
    engine_on_cpu: bool,
) -> None:
    """config.pbtxt `engine_cpus`: check it against the host and the user's thread settings (a load
    error naming both when they disagree), then move the stub's threads off the engine's CPUs (the
    engine process has moved onto them itself). `engine_on_cpu`: the engine runs on vLLM's CPU
    platform, whose worker binds its torch threads to those CPUs."""
    instances = instance_count(model_config, gpu_count())
    if instances > 1:
        raise ConfigError(
            f"model {model_name}: engine_cpus places one engine, but instance_group runs {instances} instances "
            "of this model (each would put its engine on the same CPUs): use one instance, or leave engine_cpus out"
        )
    try:
        cpu_placement.check_engine_cpus(cpus, user_threads, threads_bound=engine_on_cpu)
    except cpu_placement.CpuListError as error:
        raise ConfigError(f"model {model_name}: {error}") from None
    others = tuple(cpu for cpu in cpu_placement.allowed_cpus() if cpu not in cpus)
    if others:
        cpu_placement.pin_process(others)
    else:
        logger.warning(
            "vllm_multistep: model %s: engine_cpus %s hold every CPU the stub runs on: its threads share them",
            model_name,
            cpu_placement.cpu_list_text(cpus),
        )


def place_engine_process(cpus: tuple[int, ...], model_config: dict[str, Any], model_name: str) -> None:
    """place_engine for an engine process, either engine's: the stub imports no vLLM (vLLM 0.32 is not
    even importable here), so a host without GPUs is taken for vLLM's CPU platform (stub/device.py),
    whose worker binds its torch threads to `cpus` (the user's OMP_NUM_THREADS or
    VLLM_CPU_OMP_THREADS_BIND then disagree with engine_cpus: a load error naming both); on a GPU
    host the user's thread settings stand."""
    on_cpu = gpu_count() == 0
    place_engine(cpus, model_config, cpu_placement.thread_choice_of_user(), model_name, engine_on_cpu=on_cpu)


def _switch_ipex(settings: BackendSettings) -> None:
    """config.pbtxt `use_ipex` false: IPEX made unimportable before the first torch or vLLM import."""
    if not settings.use_ipex:
        from triton_vllm_multistep.engine.ipex_switch import turn_ipex_off

        turn_ipex_off()


class ModelServer:
    """Everything one Triton model instance runs."""

    def __init__(self, pb_utils: Any, args: dict[str, str]) -> None:
        self._pb = pb_utils
        # The one thread that calls into Triton: this one until the response thread starts, then it.
        self.caller = triton_io.TritonCaller()
        self.model_settings = self._read_settings(args)
        tokenizer = self._start_engine(args)
        self._wire_response_path(args, tokenizer)
        self._log_ready()

    def _read_settings(self, args: dict[str, str]) -> ModelSettings:
        """Phase 1: the model's settings (settings/; IPEX turned off before a demo:// model's build
        imports torch), then what the stub itself needs of the config."""
        model_config = json.loads(args["model_config"])
        model = read_model_settings(
            Path(args["model_repository"]),
            str(args.get("model_version", "1")),
            model_config,
            before_model_files=_switch_ipex,
        )
        self.model_name = args.get("model_name") or model_config["name"]
        self._backend_name = model_config.get("backend") or "vllm_multistep"
        # Names the model in this stub and the engine process it starts (tools, extension modules).
        os.environ[extensions.MODEL_NAME_ENV] = self.model_name
        extensions.install_from_environment()  # test-only fault hooks, when the environment names them
        if not self._pb.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("model_transaction_policy { decoupled: true } is required: this backend streams")
        self.settings = model.backend
        self.adapters = model.adapters
        return model

    def _start_engine(self, args: dict[str, str]) -> TokenizerSource | None:
        """Phase 2: the engine built and its runner started (in a process of its own unless settings
        say otherwise); returns where the stub's tokenizers load from (None on V1: it has none)."""
        model, settings = self.model_settings, self.settings
        # The environment the engine runs with, set before the engine process starts (it inherits it).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gib))
        kind, device_id = args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", 0))
        os.environ.update(instance_device_environment(kind, device_id, model.parallel_size))
        engine_process = launch_engine_process(settings, self.model_name)
        # The stub is a child of tritonserver: its command line says how it runs.
        self._server_command = triton_command.of_process(os.getppid())
        if settings.vllm_engine == "v1":
            assert engine_process is not None  # a V1 model's engine always has a process (or the load failed)
            return self._start_v1_engine(engine_process)
        try:
            # Before the build: vLLM sets OMP_NUM_THREADS during it.
            user_threads = cpu_placement.thread_choice_of_user()
            if engine_process is not None:
                # The engine process checks model.json against its vLLM and builds the EngineArgs: this
                # stub imports no vLLM (nor torch: stub/model_tokenizer.py).
                if settings.engine_cpus:
                    place_engine_process(settings.engine_cpus, dict(model.model_config), self.model_name)
                values, built_args = dict(model.engine_args), None
            else:
                values = engine_values(model.engine_args)  # checked against vLLM's fields (imports vLLM)
                built_args = to_engine_args(values)
            try:
                self.loop: EngineRunner = start_engine_runner(
                    settings, values, built_args, user_threads, engine_process, self.adapters or ()
                )
            except EngineBuildError as error:
                # Settings this backend refuses: a load error naming them, not a trace into the engine.
                raise ConfigError(f"model {self.model_name}: {error}") from None
        except BaseException:
            if engine_process is not None:
                engine_process.stop()  # started early, never used (a refused setting, a failed build)
            raise
        self.engine_in_process = engine_process is not None
        return TokenizerSource.of_engine_args(model.engine_args)

    def _start_v1_engine(self, engine_process: EngineProcess) -> None:
        """Phase 2 for `vllm_engine: v1`: the engine arguments go to the V1 environment as they are
        (its vLLM checks them; its refusal is the load error). Returns None: nothing in this
        environment loads a V1 model's config or tokenizer (transformers 4.51 here may not know
        it); the engine process tokenizes text prompts and detokenizes each step."""
        model, settings = self.model_settings, self.settings
        if settings.engine_cpus:
            place_engine_process(settings.engine_cpus, dict(model.model_config), self.model_name)
        engine_process.spec = EngineSpec(
            dict(model.engine_args),
            "step",
            cpus=settings.engine_cpus,
            use_ipex=False,
            max_prompt_tokens=settings.limits.max_prompt_tokens,
            lora_adapters=tuple(adapter.engine_value() for adapter in self.adapters or ()),
        )
        try:
            engine_process.start_engine()
        except BaseException as error:
            engine_process.stop()
            if isinstance(error, EngineBuildError | EngineProcessError):
                raise ConfigError(f"model {self.model_name}: vLLM's V1 engine did not build: {error}") from None
            raise
        self.loop = engine_process
        self.engine_in_process = True
        return None

    def _wire_response_path(self, args: dict[str, str], tokenizer: TokenizerSource | None) -> None:
        """Phase 3: what execute() needs, the metrics, the response thread and the drain watcher; then
        the engine starts serving. A failure here shuts the engine down."""
        try:
            self._prepare_requests(tokenizer)
            self._start_observers(args)
            self._start_responder(tokenizer)
        except BaseException:
            self.loop.shutdown()
            raise

    def _prepare_requests(self, tokenizer: TokenizerSource | None) -> None:
        """execute()'s tokenizer (none for a V1 model: `tokenizer` None; its engine process reports
        the vocabulary of model and tokenizer both) and the model's request limits."""
        facts = self.loop.facts
        # An engine process checks its requests' sampling fields with its vLLM (refusing that request
        # alone); an engine in this stub has vLLM here to check them before they are queued.
        checks_with_vllm = not self.engine_in_process
        if checks_with_vllm:
            codec.import_sampling_checks()  # here, not first in execute(): see there
        self._tokenizer = None if tokenizer is None else self._load_tokenizer(tokenizer)
        vocab_size = facts.vocab_size if self._tokenizer is None else token_ids_of(self._tokenizer, facts.vocab_size)
        self.limits = codec.ModelLimits(
            vocab_size=vocab_size,
            max_model_len=facts.max_model_len,
            limits=self.settings.limits,
            model_name=facts.model,
            images_per_prompt=facts.images_per_prompt,
            adapters=self.adapters,
            scheduling_policy=facts.scheduling_policy,
            tasks=facts.tasks,
            served_name=self.model_name,
            checks_with_vllm=checks_with_vllm,
        )

    def _start_observers(self, args: dict[str, str]) -> None:
        """The model's metrics (when on), the instance's heartbeat and restart count."""
        self.metrics = None
        if self.settings.enable_metrics:
            from triton_vllm_multistep.stub.metrics import BackendMetrics

            self.metrics = BackendMetrics(
                self._pb,
                self.model_settings.name,
                self.model_settings.version,
                self.loop.facts.max_model_len,
                instances=self.model_settings.instance_count(gpu_count()),
                caller=self.caller,
                max_loras=self.loop.facts.max_loras,
                cache_config=self.loop.facts.cache_config,
            )
        self.heartbeat = self._start_heartbeat(args)
        from triton_vllm_multistep.stub.restarts import RestartCount

        self.restart_count = self._instance_series(RestartCount, args)

    def _start_responder(self, tokenizer: TokenizerSource | None) -> None:
        """The response thread, the engine serving into it, and the drain watcher."""
        from triton_vllm_multistep.stub.responder import Responder

        self.responder = Responder(
            self._pb,
            abort=lambda rid: self.loop.abort(rid),
            observer=self.metrics,
            stream_interval=self.settings.stream_interval,
            merge_when_behind=self.settings.stream_mode == "merge",
            caller=self.caller,
        )
        if tokenizer is not None:  # a V1 model has no detokenization windows (refused per request)
            self.responder.window_decode = window_decoder(self._load_tokenizer(tokenizer))
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
            self.model_settings.version,
            self._server_command,
            self.settings.unload_drain_seconds,
            in_flight=self.responder.in_flight,
            close_intake=self.responder.close_intake,
            end_all=self.responder.end_all,
        )
        self.drain.start()

    def _log_ready(self) -> None:
        facts = self.loop.facts
        streaming = {
            "step": "step",
            "window": "scheduling window",
            "merge": "step, several steps per response once sending would slow the engine",
        }[self.settings.stream_mode]
        if self.settings.stream_interval > 1:
            streaming += f", every {self.settings.stream_interval} engine outputs"
        logger.info(
            "vllm_multistep: model %s (%s) ready: num_scheduler_steps=%d%s, streaming per %s, torch threads %s, "
            "engine %s, attention kernels %s, drains for up to %.1f s on unload",
            self.model_name,
            facts.model,
            facts.num_scheduler_steps,
            " (async scheduling)" if facts.async_scheduling else "",
            streaming,
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

    def _load_tokenizer(self, source: TokenizerSource) -> Any:
        """A tokenizer of its own for each thread that uses one: fast tokenizers are not safe to share
        across threads. Through vLLM's get_tokenizer only where the engine has loaded vLLM here."""
        return load_tokenizer(source, with_vllm=not self.engine_in_process)

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
                    encode=None if self._tokenizer is None else self._tokenizer.encode,
                    decode=None if self._tokenizer is None else self._tokenizer.decode,
                    outputs=triton_io.requested_outputs(request, OUTPUT_NAMES),
                )
            except codec.RequestError as error:
                if error.log_detail:
                    logger.info("vllm_multistep: model %s: %s (%s)", self.model_name, error, error.log_detail)
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
                    n=codec.completions_asked(generation),
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
        """Their backend's words, whole (the engine's error is in the server log: _after_engine_death_answered)."""
        return UNHEALTHY_ENGINE_MESSAGE

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
