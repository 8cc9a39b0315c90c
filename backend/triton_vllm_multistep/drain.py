"""Draining on unload and server shutdown: finish what is in flight, within Triton's exit timeout.

Owns noticing that Triton has started unloading this model (model-control unload, or the server
stopping on SIGTERM) while requests are in flight, giving them until a deadline to finish, and
then ending the rest; must not touch the engine or build responses (it calls back for that).

Why: Triton calls `finalize` only once every response sender of the model is done, so the
backend hears nothing of an unload while streams are in flight. Triton meanwhile counts down
`--exit-timeout-secs`, and when that expires with the Python backend still busy, tritonserver
2.51 does not exit (it hangs in its exit path, sometimes after a crash). Readiness is the signal
that is there: Triton reports the model not ready from the moment it starts unloading it or
stopping. It is asked over the server's own HTTP endpoint (`/v2/models/<name>/versions/<v>/ready`),
not with `pb_utils.is_model_ready`: once the server is stopping, that call fails inside the 2.51
Python backend's message handling, and doing so was seen to hang the stub's calls to the server
and to crash tritonserver (`boost::interprocess::lock_exception`). A stopping tritonserver also
stops accepting connections, so a refused connection to an endpoint that answered before means
the server is stopping.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from .triton_command import TRITON_DEFAULT_EXIT_TIMEOUT, TritonCommand

logger = logging.getLogger("triton_vllm_multistep")

# Left of the exit timeout for ending the remaining streams, finalize (engine shutdown) and
# Triton's own unloading.
DRAIN_MARGIN_SECONDS = 5.0
UNLOADING_MESSAGE = "the model is being unloaded (or the server is stopping)"
# Drain on request, before the server is told to stop: Triton 2.51 stops every model's scheduler
# as soon as it starts stopping, so an ensemble whose next step (postprocessing of the LLM's next
# response) is refused then never finishes (fixed in Triton core in 2026, not in 2.51). Draining
# first lets every ensemble stream end normally. The launcher does it on SIGTERM; for a plain
# tritonserver, `triton-vllm-multistep drain` (e.g. a Kubernetes preStop hook) does.
DRAIN_FILE_ENV = "TRITON_VLLM_MULTISTEP_DRAIN_FILE"
DRAIN_REQUESTED_MESSAGE = "the server is about to stop"


def drained_marker(drain_file: Path, stub_pid: int) -> Path:
    """The file a model instance (its stub process) creates once it has drained on request."""
    return drain_file.with_name(f"{drain_file.name}.drained.{stub_pid}")


def drain_seconds(configured: float | None, exit_timeout: float | None) -> float:
    """How long requests in flight may run on after the unload began."""
    if configured is not None:
        return configured
    timeout = TRITON_DEFAULT_EXIT_TIMEOUT if exit_timeout is None else exit_timeout
    return max(0.0, timeout - DRAIN_MARGIN_SECONDS)


def http_readiness_probe(
    endpoint: tuple[str, int], model_name: str, model_version: str, timeout: float = 2.0
) -> Callable[[], bool | None]:
    """Asks the server's HTTP endpoint whether this model version is ready: True, False, or None (no answer).

    One short connection per question: a kept-alive one would hold the server's shutdown up. A
    refused connection is "not ready" once the endpoint has answered before (the server stops
    listening when it starts stopping); before that, the server has not opened it yet.
    """
    host, port = endpoint
    path = f"/v2/models/{urllib.parse.quote(model_name, safe='')}/versions/{urllib.parse.quote(model_version)}/ready"
    warned = False
    answered = False

    def probe() -> bool | None:
        nonlocal warned, answered
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            connection.request("GET", path, headers={"Connection": "close"})
            status = connection.getresponse().status
            problem = f"HTTP {status}"
        except ConnectionRefusedError as error:
            if answered:
                return False
            status, problem = None, f"{type(error).__name__}: {error}"
        except (OSError, http.client.HTTPException) as error:
            status, problem = None, f"{type(error).__name__}: {error}"
        finally:
            connection.close()
        if status == 200:
            answered = True
            return True
        if status in (400, 503):  # Triton's answers for "not ready", the server's stopping included
            answered = True
            return False
        if status is None and not answered:
            return None  # not listening yet: the server opens its endpoints once models are loaded
        if not warned:
            warned = True
            logger.warning(
                "vllm_multistep: cannot ask tritonserver at %s:%d whether %s is ready (%s): requests in flight "
                "will not be drained on unload",
                host,
                port,
                model_name,
                problem,
            )
        return None

    return probe


class UnloadDrain:
    """A thread that drains the model's requests on unload, server stop, or request (`drain_file` appears).

    `in_flight()` counts the requests not yet answered with their FINAL; `end_all(message)` ends
    every one of them with an error FINAL. Once draining has begun, `draining` stays True (the
    model is going away: new requests are refused rather than let in to hold the unload up).
    """

    def __init__(
        self,
        model_name: str,
        is_ready: Callable[[], bool | None],
        in_flight: Callable[[], int],
        end_all: Callable[[str], None],
        drain_seconds: float,
        poll_seconds: float = 0.25,
        first_answer_poll_seconds: float = 0.02,
        drain_file: Path | None = None,
    ) -> None:
        self.model_name = model_name
        self.drain_seconds = drain_seconds
        self._is_ready = is_ready
        self._in_flight = in_flight
        self._end_all = end_all
        self._poll = poll_seconds
        self._first_answer_poll = first_answer_poll_seconds
        self._drain_file = drain_file
        self._created = time.time()
        self._stopped = threading.Event()
        self.draining = False
        self.reason = UNLOADING_MESSAGE  # why it drains, once it does
        self._thread = threading.Thread(target=self._run, name="vllm-unload-drain", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        # Readiness is asked while requests are in flight (an idle model's unload reaches finalize
        # directly), and often until the first answer: a refused connection counts as "stopping"
        # only once the endpoint has answered, and a SIGTERM can come right after the server opens
        # its endpoints (a refused local connect costs microseconds).
        answered = False
        while not self._stopped.wait(self._poll if answered else self._first_answer_poll):
            if self._drain_requested():
                self._drain(DRAIN_REQUESTED_MESSAGE)
                self._mark_drained()
                return
            busy = self._in_flight() > 0
            if answered and not busy:
                continue
            ready = self._is_ready()
            answered = answered or ready is not None
            if busy and ready is False:
                self._drain(UNLOADING_MESSAGE)
                return

    def _drain_requested(self) -> bool:
        """The drain file exists and is not a leftover from before this instance (a restarted container)."""
        if self._drain_file is None:
            return False
        try:
            return self._drain_file.stat().st_mtime >= self._created
        except OSError:
            return False

    def _mark_drained(self) -> None:
        """Tell whoever asked (launcher, `drain` command) once every FINAL has gone out."""
        deadline = time.monotonic() + 5.0
        while self._in_flight() and time.monotonic() < deadline and not self._stopped.wait(0.02):
            pass
        assert self._drain_file is not None
        try:
            drained_marker(self._drain_file, os.getpid()).touch()
        except OSError as error:
            logger.warning("vllm_multistep: model %s: cannot mark the drain done: %s", self.model_name, error)

    def _drain(self, why: str) -> None:
        self.reason = why
        self.draining = True
        count = self._in_flight()
        logger.warning(
            "vllm_multistep: model %s: %s, with %d request(s) in flight: new requests are refused, these may finish "
            "for up to %.1f s",
            self.model_name,
            why,
            count,
            self.drain_seconds,
        )
        deadline = time.monotonic() + self.drain_seconds
        while self._in_flight() and time.monotonic() < deadline:
            if self._stopped.wait(0.05):
                return
        remaining = self._in_flight()
        if remaining:
            logger.warning(
                "vllm_multistep: model %s: ending %d request(s) still in flight after %.1f s of draining",
                self.model_name,
                remaining,
                self.drain_seconds,
            )
            self._end_all(why)
        else:
            logger.info("vllm_multistep: model %s: every request in flight finished while draining", self.model_name)


def unload_drain_for(
    model_name: str,
    model_version: str,
    server: TritonCommand | None,
    configured_seconds: float | None,
    in_flight: Callable[[], int],
    end_all: Callable[[str], None],
) -> UnloadDrain:
    """The drain of one model instance, reading readiness from `server`'s HTTP endpoint (if it has one)."""
    endpoint = server.http_endpoint if server else None
    if endpoint is None:
        logger.warning(
            "vllm_multistep: model %s: tritonserver's HTTP endpoint is off or unknown, so an unload or server stop "
            "is not noticed while requests are in flight: they are not drained",
            model_name,
        )
    drain_file = os.environ.get(DRAIN_FILE_ENV)
    return UnloadDrain(
        model_name,
        http_readiness_probe(endpoint, model_name, model_version) if endpoint else lambda: None,
        in_flight,
        end_all,
        drain_seconds(configured_seconds, server.exit_timeout if server else None),
        drain_file=Path(drain_file) if drain_file else None,
    )
