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

from triton_vllm_multistep.lifecycle import procfs
from triton_vllm_multistep.lifecycle.protocol import (
    CLOCK_SLACK_SECONDS,
    DRAIN_FILE_ENV,
    DRAIN_MARGIN_SECONDS,
    DRAIN_REQUESTED_MESSAGE,
    READINESS_FIRST_ANSWER_POLL_SECONDS,
    READINESS_POLL_SECONDS,
    UNLOADING_MESSAGE,
    drained_marker,
)
from triton_vllm_multistep.lifecycle.triton_command import TritonCommand, exit_timeout_of

logger = logging.getLogger("triton_vllm_multistep")


def drain_seconds(configured: float | None, exit_timeout: float) -> float:
    """How long requests in flight may run on after the unload began."""
    if configured is not None:
        return configured
    return max(0.0, exit_timeout - DRAIN_MARGIN_SECONDS)


class HttpReadiness:
    """Asks the server's HTTP endpoint whether this model version is ready: True, False, or None (no answer).

    One short connection per question: a kept-alive one would hold the server's shutdown up. A
    refused connection is "not ready" once the endpoint has answered before (the server stops
    listening when it starts stopping); before that, the server has not opened it yet.
    """

    def __init__(self, endpoint: tuple[str, int], model_name: str, model_version: str, timeout: float = 2.0) -> None:
        self.host, self.port = endpoint
        self.model_name = model_name
        self.path = (
            f"/v2/models/{urllib.parse.quote(model_name, safe='')}/versions/{urllib.parse.quote(model_version)}/ready"
        )
        self.timeout = timeout
        self.answered = False  # the endpoint has answered (any HTTP status) at least once
        self._failures = 0
        self._warned = False

    def __call__(self) -> bool | None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            connection.request("GET", self.path, headers={"Connection": "close"})
            status: int | None = connection.getresponse().status
            problem = f"HTTP {status}"
        except ConnectionRefusedError:
            if self.answered:
                return False
            return None  # not listening yet: the server opens its endpoints once models are loaded
        except (OSError, http.client.HTTPException) as error:
            status, problem = None, f"{type(error).__name__}: {error}"
        finally:
            connection.close()
        if status is not None:
            self.answered = True
        if status == 200:
            self._failures = 0
            return True
        if status in (400, 503):  # Triton's answers for "not ready", the server's stopping included
            self._failures = 0
            return False
        self._failures += 1
        if self._failures >= 3 and not self._warned:
            self._warned = True
            logger.warning(
                "vllm_multistep: cannot ask tritonserver at %s:%d whether %s is ready (%s): an unload or server stop "
                "is not noticed while this lasts",
                self.host,
                self.port,
                self.model_name,
                problem,
            )
        return None


class UnloadDrain:
    """A thread that drains the model's requests on unload, server stop, or request (`drain_file`).

    `in_flight()` counts the requests not yet answered with their FINAL; `close_intake(reason)`
    makes every later request be refused (atomically with registering requests); `end_all(reason)`
    ends every request in flight with an error FINAL. `is_ready` (None: readiness cannot be
    watched) says whether Triton still serves the model. A drain request is a line holding this
    instance's tritonserver pid in `drain_file`, written after the instance's process started.
    """

    def __init__(
        self,
        model_name: str,
        is_ready: Callable[[], bool | None] | None,
        in_flight: Callable[[], int],
        close_intake: Callable[[str], None],
        end_all: Callable[[str], None],
        drain_seconds: float,
        poll_seconds: float = READINESS_POLL_SECONDS,
        first_answer_poll_seconds: float = READINESS_FIRST_ANSWER_POLL_SECONDS,
        drain_file: Path | None = None,
    ) -> None:
        self.model_name = model_name
        self.drain_seconds = drain_seconds
        self._is_ready = is_ready
        self._in_flight = in_flight
        self._close_intake = close_intake
        self._end_all = end_all
        self._poll = poll_seconds
        self._first_answer_poll = first_answer_poll_seconds
        self._drain_file = drain_file
        # A drain file written before this process started is a leftover (a restarted container
        # keeps /tmp).
        self._requests_after = (procfs.started_at(os.getpid()) or time.time()) - CLOCK_SLACK_SECONDS
        self._server_pid = str(os.getppid())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-unload-drain", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _waiting_for_first_answer(self) -> bool:
        return self._is_ready is not None and not getattr(self._is_ready, "answered", True)

    def _run(self) -> None:
        # Readiness is asked while requests are in flight (an idle model's unload reaches finalize
        # directly), and often until the endpoint first answers: a refused connection counts as
        # "stopping" only after that, and a SIGTERM can come right after the server opens its
        # endpoints (a refused local connect costs microseconds).
        while not self._stopped.wait(self._first_answer_poll if self._waiting_for_first_answer() else self._poll):
            if self._drain_requested():
                count = self._drain(DRAIN_REQUESTED_MESSAGE)
                self._mark_drained(count)
                return
            if self._is_ready is None:
                continue
            busy = self._in_flight() > 0
            if not busy and not self._waiting_for_first_answer():
                continue
            if self._is_ready() is False and busy:
                self._drain(UNLOADING_MESSAGE)
                return

    def _drain_requested(self) -> bool:
        if self._drain_file is None:
            return False
        try:
            if self._drain_file.stat().st_mtime < self._requests_after:
                return False
            return self._server_pid in self._drain_file.read_text().split()
        except OSError:
            return False

    def _wait_idle(self, seconds: float, interval: float) -> bool:
        """Until no request is in flight or `seconds` pass; False if the drain was stopped meanwhile."""
        deadline = time.monotonic() + seconds
        while self._in_flight() and time.monotonic() < deadline:
            if self._stopped.wait(interval):
                return False
        return True

    def _mark_drained(self, count: int) -> None:
        """Tell whoever asked (launcher, `drain` command), once the requests are answered, how many there were."""
        self._wait_idle(5.0, interval=0.02)
        assert self._drain_file is not None
        marker = drained_marker(self._drain_file, os.getpid())
        staging = marker.with_name(f".{marker.name}.writing")
        try:
            # Whole or absent: a reader that found the marker created but not yet written read 0 requests.
            staging.write_text(f"{count}\n")
            os.replace(staging, marker)
        except OSError as error:
            logger.warning("vllm_multistep: model %s: cannot mark the drain done: %s", self.model_name, error)

    def _drain(self, why: str) -> int:
        """Refuse new requests, give those in flight `drain_seconds`, end the rest; returns how many were in flight."""
        self._close_intake(why)
        count = self._in_flight()
        logger.warning(
            "vllm_multistep: model %s: %s, with %d request(s) in flight: new requests are refused, these may finish "
            "for up to %.1f s",
            self.model_name,
            why,
            count,
            self.drain_seconds,
        )
        if not self._wait_idle(self.drain_seconds, interval=0.05):
            return count
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
        return count


def unload_drain_for(
    model_name: str,
    model_version: str,
    server: TritonCommand | None,
    configured_seconds: float | None,
    in_flight: Callable[[], int],
    close_intake: Callable[[str], None],
    end_all: Callable[[str], None],
) -> UnloadDrain:
    """The drain of one model instance, reading readiness from `server`'s HTTP endpoint (if it has one)."""
    endpoint = server.http_endpoint if server else None
    drain_file = os.environ.get(DRAIN_FILE_ENV)
    if endpoint is None:
        logger.warning(
            "vllm_multistep: model %s: tritonserver's HTTP endpoint is off or unknown, so an unload or server stop "
            "is not noticed while requests are in flight (%s)",
            model_name,
            f"only a drain request through {drain_file} drains them" if drain_file else "they are not drained",
        )
    return UnloadDrain(
        model_name,
        HttpReadiness(endpoint, model_name, model_version) if endpoint else None,
        in_flight,
        close_intake,
        end_all,
        drain_seconds(configured_seconds, exit_timeout_of(server)),
        drain_file=Path(drain_file) if drain_file else None,
    )
