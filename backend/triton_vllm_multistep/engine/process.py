"""The engine in a process of its own (config.pbtxt `engine_process`, on by default): the stub's side,
EngineProcess, with EngineLoop's surface, and the child's side, `serve_engine`, joined by a socket pair.

Why: in one process the engine thread (scheduling, pythonization, detokenization) and the
response thread (building and sending one Triton response per stream per step) share one GIL, so
every response built is engine time lost once many streams run (vLLM's own server runs its
engine in a process of its own for the same reason, MQLLMEngine). Here the child runs an
ordinary EngineLoop; its events cross as pickles and reach the stub's sink in the same order.
The stub may launch the child before it has the engine's settings (`launch`): the child turns
IPEX off or not and imports vLLM while the stub imports its own, then builds what `start_engine`
sends.

Owns starting, feeding, watching and stopping the engine process (the multi-step one, or with
`v1` vLLM's current engine under the V1 environment's Python: engine_v1/), and the multi-step
child's side. The messages between the two sides are engine/messages.py's and engine/events.py's:
typed plain values (EngineSpec, EngineRequest, Abort, Serve, Stop one way; Built or BuildFailed,
the engine's events, KvCacheStats, Stopped the other), none of them vLLM's, torch's or numpy's
(tests/unit/test_engine_messages.py unpickles each where those cannot load). Must not know
Triton. Imports no vLLM at module level: the stub imports it before it may turn IPEX off, and the
child runs it before it does.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.engine.events import (
    EngineDied,
    EngineEvent,
    EngineFacts,
    EngineRequest,
    KvCacheStats,
    RequestFailed,
    StepOutputs,
)
from triton_vllm_multistep.engine.messages import (  # the process's messages, reachable from here too
    Abort,
    BuildFailed,
    Built,
    EngineProcessError,
    EngineSpec,
    FromEngine,
    NoPythonForEngineProcess,
    Serve,
    Stop,
    Stopped,
    ToEngine,
    build_failure,
    sender,
)
from triton_vllm_multistep.settings.v1_environment import configured_v1_python, no_v1_environment, v1_environment

logger = logging.getLogger(__name__)

# How long stop() waits for the engine process to shut its engine down before terminating it.
STOP_SECONDS = 20.0
PYTHON_ENV = "TRITON_VLLM_MULTISTEP_PYTHON"
V1_ENTRY_MODULE = "triton_vllm_multistep.engine_v1.process"
# `python -m ENTRY_MODULE FD` runs an engine process (tools find engine processes by it too).
ENTRY_MODULE = "triton_vllm_multistep.engine.process"
# Its second argument: whether IPEX may load in it (use_ipex), known before the spec is; its third:
# the CPUs it runs on (a CPU list, or cpu_placement.ALL_CPUS: those it inherits).
IPEX_ARGUMENT = {True: "ipex", False: "no-ipex"}


def python_for_children() -> str | None:
    """The interpreter that runs the engine process, or None if there is none.

    The TRITON_VLLM_MULTISTEP_PYTHON environment variable, else this interpreter when it is a
    Python executable, else the python of this version first on PATH (inside Triton's stub,
    `sys.executable` is not a Python that takes `-m`: the stub embeds libpython; the launcher puts
    this environment's interpreter first on PATH). Another version would not load this
    environment's compiled packages, so none is tried.
    """
    chosen = os.environ.get(PYTHON_ENV)
    if chosen:
        return chosen
    if sys.executable and os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}")


def _no_python_message(detail: str) -> str:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"could not start the engine process ({detail}): set {PYTHON_ENV} to a Python {version} that has "
        "this environment's packages"
    )


class EngineProcess:
    """EngineLoop's surface (start_engine, serve, submit, abort, stop, healthy, error, torch_threads),
    with the engine in a child process. Events reach `sink` from one reader thread, in order."""

    def __init__(self, spec: EngineSpec | None = None, python: str | None = None, v1: bool = False) -> None:
        self.spec = spec  # what start_engine sends; may be set after launch()
        # v1: vLLM's current engine (engine_v1/) under the V1 environment's Python, which is given
        # this package alone of the stub's import paths (its own vLLM, numpy and transformers).
        self._v1 = v1
        # None: start_engine raises NoPythonForEngineProcess
        self._python = python or (configured_v1_python() if v1 else python_for_children())
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._sink: Callable[[EngineEvent], None] = lambda _event: None
        self._on_state: Callable[[KvCacheStats], None] | None = None
        self._in_flight: set[str] = set()
        self._in_flight_lock = threading.Lock()
        self._serving = False
        self._stopping = False
        self.error: str | None = None
        self.torch_threads: int | None = None
        self._facts: EngineFacts | None = None
        self._spec_sent = False

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("the engine is not built")
        return self._facts

    @property
    def healthy(self) -> bool:
        return self.error is None and self._serving and self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def launch(self, use_ipex: bool, cpus: tuple[int, ...] = ()) -> None:
        """Start the process now, before the spec is ready: it moves onto `cpus` (if any), turns IPEX
        off or not and imports vLLM while the stub does its own imports (start_engine sends the spec).
        Raises NoPythonForEngineProcess when no Python can start it."""
        if self._python is None and self._v1:
            raise NoPythonForEngineProcess(no_v1_environment("the V1 engine process"))
        if self._python is None:
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            raise NoPythonForEngineProcess(_no_python_message(f"no {version} on PATH and {PYTHON_ENV} is not set"))
        ours, theirs = socket.socketpair()
        if self._v1:
            environment = v1_environment(os.environ)
        else:
            environment = dict(os.environ)
            # This interpreter's import paths (the stub's: the package and its environment's packages).
            environment["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
        if cpus:
            environment.update(cpu_placement.engine_thread_environment(cpus))
        placement = cpu_placement.cpu_list_text(cpus) if cpus else cpu_placement.ALL_CPUS
        logger.info("starting the vLLM %s engine process with %s", "V1" if self._v1 else "multi-step", self._python)
        entry = V1_ENTRY_MODULE if self._v1 else ENTRY_MODULE
        try:
            self._process = subprocess.Popen(
                [self._python, "-m", entry, str(theirs.fileno()), IPEX_ARGUMENT[use_ipex], placement],
                pass_fds=[theirs.fileno()],
                env=environment,
                stdin=subprocess.DEVNULL,
            )
        except OSError as error:
            ours.close()
            raise NoPythonForEngineProcess(_no_python_message(f"{self._python!r}: {error}")) from None
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())

    def start_engine(self) -> EngineFacts:
        """Send the spec (launching the process first unless launch() did) and wait until it has built
        (and warmed up) the engine; raises its failure (NoPythonForEngineProcess when no Python could
        start it)."""
        if self.spec is None:
            raise RuntimeError("EngineProcess.start_engine needs a spec")
        if self._process is None:
            self.launch(self.spec.use_ipex, self.spec.cpus)
        assert self._connection is not None and self._process is not None
        self._spec_sent = True
        self._send(self.spec)
        try:
            message = self._connection.recv()
        except (EOFError, OSError):
            raise EngineProcessError(
                "the vLLM engine process exited while building the engine "
                f"(exit code {self._process.wait(30)}; its output is in the server log)"
            ) from None
        if isinstance(message, BuildFailed):
            self._process.wait(30)
            error = message.error
            raise error if isinstance(error, BaseException) else EngineProcessError(str(error))
        if not isinstance(message, Built):
            raise EngineProcessError(f"the vLLM engine process answered its spec with {type(message).__name__}")
        self._facts, self.torch_threads = message.facts, message.torch_threads
        return self._facts

    def serve(
        self,
        sink: Callable[[EngineEvent], None],
        on_state: Callable[[KvCacheStats], None] | None = None,
        state_interval: float = 0.25,
        time_steps: bool = False,
    ) -> None:
        self._sink, self._on_state = sink, on_state
        self._serving = True
        self._reader = threading.Thread(target=self._read_events, name="vllm-engine-process-events", daemon=True)
        self._reader.start()
        self._send(Serve(state_interval, time_steps, on_state is not None))

    def submit(self, request: EngineRequest) -> None:
        with self._in_flight_lock:
            self._in_flight.add(request.request_id)
        self._send(request)  # crosses as itself

    def abort(self, request_id: str) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(request_id)
        self._send(Abort(request_id))

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the engine (the child shuts its executor down) and the process; idempotent."""
        self._stopping = True
        if self._process is None:
            return
        if not self._spec_sent and self._process.poll() is None:
            # Launched, never given anything to build (the stub's load failed first): nothing to shut down.
            self._process.terminate()
        self._send(Stop())
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the vLLM engine process did not stop within %.0f s: terminating it", timeout)
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)

    def shutdown(self) -> None:
        """EngineLoop's shutdown: here the engine process shuts its executor down when it stops."""
        self.stop()

    def _send(self, message: ToEngine) -> None:
        if self._connection is None:
            return
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError):
            # The process is gone: the reader reports its death (once) to every request in flight.
            pass

    def _read_events(self) -> None:
        assert self._connection is not None and self._process is not None
        while True:
            try:
                message: FromEngine = self._connection.recv()
            except (EOFError, OSError):
                break
            except Exception as error:  # an event that does not unpickle: the engine's state is unknown
                self._died(f"vLLM engine process sent an unreadable event: {error!r}")
                return
            if isinstance(message, KvCacheStats):
                if self._on_state is not None:
                    try:
                        self._on_state(message)
                    except Exception:
                        logger.exception("reporting engine state failed")
                continue
            if isinstance(message, Stopped):
                break
            if not isinstance(message, StepOutputs | RequestFailed | EngineDied):
                self._died(f"vLLM engine process sent an unexpected message: {type(message).__name__}")
                return
            self._forget_ended(message)
            if isinstance(message, EngineDied):
                self._died(message.message, message)
                return
            self._sink(message)
        if not self._stopping:
            try:
                code: int | None = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self._died(f"vLLM engine failed: the engine process exited (exit code {code})")

    def _forget_ended(self, event: EngineEvent) -> None:
        with self._in_flight_lock:
            if isinstance(event, StepOutputs):
                for output in event.outputs:
                    if output.finished:
                        self._in_flight.discard(output.request_id)
            elif isinstance(event, RequestFailed):
                self._in_flight.discard(event.request_id)

    def _died(self, message: str, event: EngineDied | None = None) -> None:
        if self.error is not None:
            return
        self.error = message
        logger.error("%s", message)
        with self._in_flight_lock:
            lost = sorted(self._in_flight)
            self._in_flight.clear()
        self._sink(EngineDied(message, sorted(set(lost) | set(event.request_ids if event else []))))


def serve_engine(connection: Connection) -> None:
    """The engine process: build the engine in an EngineLoop, then follow the stub's commands."""
    send = sender(connection)
    try:
        message: ToEngine = connection.recv()
    except (EOFError, OSError):
        return  # the stub is gone before sending anything to build
    if not isinstance(message, EngineSpec):
        return  # stopped before it had anything to build (the stub's load failed first)
    loop, engine = _built_loop(message, connection)
    if loop is None:
        return
    from triton_vllm_multistep.engine.loop import engine_facts

    send(Built(engine_facts(engine), loop.torch_threads))
    try:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break  # the stub is gone: stop
            if isinstance(message, EngineRequest):
                loop.submit(message)
            elif isinstance(message, Abort):
                loop.abort(message.request_id)
            elif isinstance(message, Serve):
                loop.serve(
                    sink=send,
                    on_state=send if message.report_state else None,
                    state_interval=message.state_interval,
                    time_steps=message.time_steps,
                )
            elif isinstance(message, Stop):
                break
    finally:
        try:
            loop.shutdown()
        finally:
            try:
                send(Stopped())
            except (OSError, ValueError):
                pass


def prepare(use_ipex: bool, placement: str = cpu_placement.ALL_CPUS) -> None:
    """The engine process's first act, before its spec arrives: onto its CPUs (`placement`, a CPU
    list), IPEX off or not, then vLLM imported."""
    if placement != cpu_placement.ALL_CPUS:
        cpu_placement.pin_process(cpu_placement.parse_cpu_list(placement))
    if not use_ipex:
        from triton_vllm_multistep.engine.ipex_switch import turn_ipex_off

        turn_ipex_off()  # before vLLM is imported in this process
    import triton_vllm_multistep.engine.loop  # noqa: F401  (vLLM and torch: the slow part of a start)
    from triton_vllm_multistep.engine.extensions import install_from_environment

    install_from_environment()


def _built_loop(spec: EngineSpec, connection: Connection) -> tuple[Any, Any]:
    """(loop, engine) once built and warmed up; (None, None) after sending the build's failure."""
    try:
        from triton_vllm_multistep.engine.engine_args import engine_values, to_engine_args
        from triton_vllm_multistep.engine.ipex_switch import ipex_turned_off
        from triton_vllm_multistep.engine.loop import serving_loop

        if ipex_turned_off() == spec.use_ipex:
            raise EngineProcessError(f"the engine process was started with use_ipex={not spec.use_ipex}")
        if spec.cpus and set(spec.cpus) != os.sched_getaffinity(0):
            placed = cpu_placement.cpu_list_text(os.sched_getaffinity(0))
            raise EngineProcessError(f"the engine process runs on CPUs {placed}, not engine_cpus {spec.cpus}")
        user_threads = spec.user_threads
        if spec.cpus:
            # launch() gave this process vLLM's binding of one torch thread to each of its CPUs; the
            # serving thread policy (all cores but one) is for an engine that shares its cores.
            user_threads = {**user_threads, **cpu_placement.engine_thread_environment(spec.cpus)}
        loop = serving_loop(
            # model.json's fields as the stub read them: checked against this vLLM here (the stub imports none).
            to_engine_args(engine_values(spec.engine_args)),
            spec.stream_mode,  # type: ignore[arg-type]
            user_threads,
            spec.lora_adapters,
        )
        engine = loop.start_engine()
    except BaseException as error:
        connection.send(build_failure(error))
        return None, None
    return loop, engine


if __name__ == "__main__":
    # The engine process's entry (`python -m triton_vllm_multistep.engine.process FD`), through the
    # package's module so that pickled names resolve to one copy of it.
    from triton_vllm_multistep.engine import process
    from triton_vllm_multistep.logs import log_package_to_stderr

    log_package_to_stderr()
    process.prepare(use_ipex=sys.argv[2] == IPEX_ARGUMENT[True], placement=sys.argv[3])
    process.serve_engine(Connection(int(sys.argv[1])))
    # The engine and its executor are shut down: skip the interpreter's teardown of torch and vLLM
    # (~2 s measured), which a server stopping within its exit timeout waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
