"""Unload drain: the exit timeout it is derived from, its config parameter, and its decisions.

The decisions are driven here with plain callables standing in for Triton's readiness answer and
the responder; the real thing (tritonserver, SIGTERM and model-control unload with streams in
flight) is in test_health_lifecycle.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from triton_vllm_multistep import config, drain


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"], 30.0),
        (["tritonserver", "--exit-timeout-secs=12"], 12.0),
        (["tritonserver", "--exit-timeout-secs", "7", "--model-repository=/m"], 7.0),
        (["tritonserver", "--exit-timeout-secs=5", "--exit-timeout-secs=9"], 9.0),  # the last one wins
        (["tritonserver", "--exit-timeout-secs=soon"], None),
        (["/usr/bin/python3", "--exit-timeout-secs=5"], None),  # not tritonserver: unknown
        ([], None),
    ],
)
def test_exit_timeout_from_a_tritonserver_command_line(argv: list[str], expected: float | None) -> None:
    assert drain.exit_timeout_from_args(argv) == expected


def test_server_exit_timeout_reads_the_process_command_line() -> None:
    assert drain.server_exit_timeout(os.getpid()) is None  # pytest is not tritonserver
    assert drain.server_exit_timeout(2**22 + 12345) is None  # no such process


def test_drain_seconds_leave_a_margin_of_the_exit_timeout() -> None:
    assert drain.drain_seconds(None, 30.0) == 25.0
    assert drain.drain_seconds(None, None) == 25.0  # Triton's default exit timeout
    assert drain.drain_seconds(None, 3.0) == 0.0
    assert drain.drain_seconds(2.5, 30.0) == 2.5  # configured wins


def _config(parameters: dict[str, str]) -> dict:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_unload_drain_seconds_parameter() -> None:
    assert config.backend_settings(_config({}), {}).unload_drain_seconds is None
    assert config.backend_settings(_config({"unload_drain_seconds": " 4.5 "}), {}).unload_drain_seconds == 4.5
    assert config.backend_settings(_config({"unload_drain_seconds": "0"}), {}).unload_drain_seconds == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(config.ConfigError, match="unload_drain_seconds"):
            config.backend_settings(_config({"unload_drain_seconds": bad}), {})


class Model:
    """What the drain sees of a model instance: readiness, requests in flight, ending them."""

    def __init__(self, in_flight: int, ready: bool | None = True) -> None:
        self.ready = ready
        self.requests = in_flight
        self.ended: list[str] = []
        self.probes = 0
        self.lock = threading.Lock()

    def is_ready(self) -> bool | None:
        self.probes += 1
        return self.ready

    def in_flight(self) -> int:
        with self.lock:
            return self.requests

    def end_all(self, message: str) -> None:
        with self.lock:
            self.ended.append(message)
            self.requests = 0

    def watch(self, drain_seconds: float) -> drain.UnloadDrain:
        watcher = drain.UnloadDrain("m", self.is_ready, self.in_flight, self.end_all, drain_seconds, poll_seconds=0.01)
        watcher.start()
        return watcher


def _until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_requests_still_in_flight_at_the_deadline_are_ended_once() -> None:
    model = Model(in_flight=3)
    watcher = model.watch(drain_seconds=0.2)
    try:
        time.sleep(0.05)
        assert not watcher.draining and not model.ended  # ready: nothing happens
        model.ready = False
        assert _until(lambda: watcher.draining)
        started = time.monotonic()
        assert _until(lambda: bool(model.ended))
        assert time.monotonic() - started >= 0.15  # they had the drain time first
        assert model.ended == [drain.UNLOADING_MESSAGE]
        time.sleep(0.1)
        assert model.ended == [drain.UNLOADING_MESSAGE] and watcher.draining
    finally:
        watcher.stop()


def test_requests_that_finish_within_the_drain_are_not_ended() -> None:
    model = Model(in_flight=2, ready=False)
    watcher = model.watch(drain_seconds=5.0)
    try:
        assert _until(lambda: watcher.draining)
        with model.lock:
            model.requests = 0  # they got their FINALs
        watcher._thread.join(2.0)
        assert not watcher._thread.is_alive()
        assert model.ended == []
    finally:
        watcher.stop()


def test_readiness_is_not_asked_while_idle_nor_acted_on_when_unknown() -> None:
    model = Model(in_flight=0, ready=False)
    watcher = model.watch(drain_seconds=0.0)
    try:
        time.sleep(0.1)
        assert model.probes == 0 and not watcher.draining  # an idle unload goes straight to finalize
        model.ready, model.requests = None, 1  # Triton could not say
        time.sleep(0.1)
        assert model.probes > 0 and not watcher.draining and model.ended == []
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive()


class _FakeTritonError(Exception):
    pass


class _ReadinessOf:
    """pb_utils.is_model_ready's two ways of saying "not ready": False, or raising while the server stops."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[tuple[str, str]] = []

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        self.asked.append((model_name, model_version))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_readiness_probe_maps_triton_answers() -> None:
    ready = _ReadinessOf(True)
    assert drain.readiness_probe(ready, "llm", "1")() is True
    assert ready.asked == [("llm", "1")]
    assert drain.readiness_probe(_ReadinessOf(False), "llm", "1")() is False
    assert drain.readiness_probe(_ReadinessOf(_FakeTritonError("Server not ready")), "llm", "1")() is False
    assert drain.readiness_probe(_ReadinessOf(_FakeTritonError("IPC broke")), "llm", "1")() is None
