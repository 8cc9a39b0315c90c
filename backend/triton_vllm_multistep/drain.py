"""Draining on unload and server shutdown: finish what is in flight, within Triton's exit timeout.

Owns noticing that Triton has started unloading this model (model-control unload, or the server
stopping on SIGTERM) while requests are in flight, giving them until a deadline to finish, and
then ending the rest; must not touch the engine or build responses (it calls back for that).

Why: Triton calls `finalize` only once every response sender of the model is done, so the
backend hears nothing of an unload while streams are in flight. Triton meanwhile counts down
`--exit-timeout-secs`, and when that expires with the Python backend still busy, tritonserver
2.51 crashes in its exit path and can hang instead of exiting. Readiness is the signal that is
there: Triton reports the model not ready from the moment it starts unloading it or stopping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger("triton_vllm_multistep")

TRITON_DEFAULT_EXIT_TIMEOUT = 30.0
# Left of the exit timeout for ending the remaining streams, finalize (engine shutdown) and
# Triton's own unloading.
DRAIN_MARGIN_SECONDS = 5.0
EXIT_TIMEOUT_FLAG = "--exit-timeout-secs"
UNLOADING_MESSAGE = "the model is being unloaded (or the server is stopping)"


def exit_timeout_from_args(argv: Sequence[str]) -> float | None:
    """`--exit-timeout-secs` of a tritonserver command line (Triton's default if absent); None if not tritonserver."""
    if not argv or Path(argv[0]).name != "tritonserver":
        return None
    value: str | None = None
    for index, arg in enumerate(argv):
        if arg.startswith(EXIT_TIMEOUT_FLAG + "="):
            value = arg.split("=", 1)[1]
        elif arg == EXIT_TIMEOUT_FLAG and index + 1 < len(argv):
            value = argv[index + 1]
    if value is None:
        return TRITON_DEFAULT_EXIT_TIMEOUT
    try:
        return float(value)
    except ValueError:
        return None


def server_exit_timeout(pid: int) -> float | None:
    """The exit timeout of tritonserver process `pid` (the stub's parent), None if unknown."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return exit_timeout_from_args([part.decode(errors="replace") for part in raw.split(b"\0") if part])


def drain_seconds(configured: float | None, exit_timeout: float | None) -> float:
    """How long requests in flight may run on after the unload began."""
    if configured is not None:
        return configured
    timeout = TRITON_DEFAULT_EXIT_TIMEOUT if exit_timeout is None else exit_timeout
    return max(0.0, timeout - DRAIN_MARGIN_SECONDS)


def readiness_probe(pb_utils, model_name: str, model_version: str) -> Callable[[], bool | None]:
    """`pb_utils.is_model_ready` for this model: False once Triton unloads it or stops; None if it cannot say."""
    warned = False

    def probe() -> bool | None:
        nonlocal warned
        try:
            return bool(pb_utils.is_model_ready(model_name=model_name, model_version=model_version))
        except Exception as error:
            # A stopping server answers "Server not ready" (UNAVAILABLE) instead of False.
            text = str(error).lower()
            if "not ready" in text or "exiting" in text or "stopping" in text:
                return False
            if not warned:
                warned = True
                logger.warning("vllm_multistep: cannot ask Triton whether %s is ready: %s", model_name, error)
            return None

    return probe


class UnloadDrain:
    """A thread that watches readiness while requests are in flight and drains them on unload.

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
    ) -> None:
        self.model_name = model_name
        self.drain_seconds = drain_seconds
        self._is_ready = is_ready
        self._in_flight = in_flight
        self._end_all = end_all
        self._poll = poll_seconds
        self._stopped = threading.Event()
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="vllm-unload-drain", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        # Readiness is only asked while requests are in flight: an idle model's unload reaches
        # finalize directly, and a probe is an IPC round trip to tritonserver.
        while not self._stopped.wait(self._poll):
            if self._in_flight() and self._is_ready() is False:
                self._drain()
                return

    def _drain(self) -> None:
        self.draining = True
        count = self._in_flight()
        logger.warning(
            "vllm_multistep: model %s is being unloaded (or the server is stopping) with %d request(s) in flight: "
            "letting them finish for up to %.1f s",
            self.model_name,
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
            self._end_all(UNLOADING_MESSAGE)
        else:
            logger.info("vllm_multistep: model %s: every request in flight finished while draining", self.model_name)
