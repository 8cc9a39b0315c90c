"""Unload drain: the server settings it reads, its config parameter, its readiness probe, its decisions.

The decisions are driven here with plain callables standing in for the readiness probe and the
responder, the probe with a local HTTP server; the real thing (tritonserver, SIGTERM and
model-control unload with streams in flight) is in test_health_lifecycle.py.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest

from triton_vllm_multistep.lifecycle import drain, procfs, protocol, server_drain, triton_command
from triton_vllm_multistep.lifecycle.triton_command import TritonCommand
from triton_vllm_multistep.settings import backend, parameters
from triton_vllm_multistep.testing.polling import wait_for


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"],
            TritonCommand(30.0, ("127.0.0.1", 8000), "none"),
        ),
        (
            ["tritonserver", "--exit-timeout-secs=12", "--http-port", "8123", "--model-control-mode=explicit"],
            TritonCommand(12.0, ("127.0.0.1", 8123), "explicit"),
        ),
        (
            ["tritonserver", "--exit-timeout-secs", "5", "--exit-timeout-secs=9", "--http-address=10.1.2.3"],
            TritonCommand(9.0, ("10.1.2.3", 8000), "none"),  # the last value wins
        ),
        (["tritonserver", "--allow-http=false", "--http-port=1"], TritonCommand(30.0, None, "none")),
        (["tritonserver", "--http-address=::", "--http-port=8001"], TritonCommand(30.0, ("::1", 8001), "none")),
        (["tritonserver", "--exit-timeout-secs=soon", "--http-port=x"], TritonCommand(None, None, "none")),
        (["/usr/bin/python3", "--exit-timeout-secs=5"], None),  # not tritonserver: nothing known
        ([], None),
    ],
)
def test_what_a_tritonserver_command_line_says(argv: list[str], expected: TritonCommand | None) -> None:
    assert triton_command.parse(argv) == expected


def test_command_line_of_a_process() -> None:
    assert triton_command.of_process(os.getpid()) is None  # pytest is not tritonserver
    assert triton_command.of_process(2**22 + 12345) is None  # no such process


def test_a_process_age_is_read_from_proc_to_the_clock_tick() -> None:
    """The probe's --timeout counts from its process's start (the kubelet's timeoutSeconds does)."""
    child = subprocess.Popen(["sleep", "5"])
    try:
        time.sleep(0.6)
        age = procfs.age(child.pid)
        assert age is not None and 0.5 <= age < 3.0, age
    finally:
        child.kill()
        child.wait()
    assert procfs.age(child.pid) is None  # gone


def test_drain_seconds_leave_a_margin_of_the_exit_timeout() -> None:
    assert drain.drain_seconds(None, 30.0) == 25.0
    assert drain.drain_seconds(None, triton_command.exit_timeout_of(None)) == 25.0  # Triton's default exit timeout
    assert drain.drain_seconds(None, 3.0) == 0.0
    assert drain.drain_seconds(2.5, 30.0) == 2.5  # configured wins


def _config(parameters: dict[str, str]) -> dict:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_unload_drain_seconds_parameter() -> None:
    assert backend.backend_settings(_config({}), {}).unload_drain_seconds is None
    assert backend.backend_settings(_config({"unload_drain_seconds": " 4.5 "}), {}).unload_drain_seconds == 4.5
    assert backend.backend_settings(_config({"unload_drain_seconds": "0"}), {}).unload_drain_seconds == 0.0
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(parameters.ConfigError, match="unload_drain_seconds"):
            backend.backend_settings(_config({"unload_drain_seconds": bad}), {})


class Readiness:
    """What the drain asks: is the model still served (True/False, None: no answer)."""

    def __init__(self, ready: bool | None) -> None:
        self.ready = ready
        self.probes = 0
        self.answered = False  # as HttpReadiness: the endpoint has answered once

    def __call__(self) -> bool | None:
        self.probes += 1
        self.answered = self.answered or self.ready is not None
        return self.ready


class Model:
    """What the drain sees of a model instance: readiness, requests in flight, intake, ending them."""

    def __init__(self, in_flight: int, ready: bool | None = True) -> None:
        self.readiness = Readiness(ready)
        self.requests = in_flight
        self.ended: list[str] = []
        self.intake_closed: str | None = None
        self.lock = threading.Lock()

    @property
    def ready(self) -> bool | None:
        return self.readiness.ready

    @ready.setter
    def ready(self, value: bool | None) -> None:
        self.readiness.ready = value

    @property
    def probes(self) -> int:
        return self.readiness.probes

    def in_flight(self) -> int:
        with self.lock:
            return self.requests

    def close_intake(self, reason: str) -> None:
        self.intake_closed = reason

    def end_all(self, message: str) -> None:
        with self.lock:
            self.ended.append(message)
            self.requests = 0

    def watch(self, drain_seconds: float, drain_file: Path | None = None) -> drain.UnloadDrain:
        watcher = drain.UnloadDrain(
            "m",
            self.readiness,
            self.in_flight,
            self.close_intake,
            self.end_all,
            drain_seconds,
            poll_seconds=0.01,
            first_answer_poll_seconds=0.005,
            drain_file=drain_file,
        )
        watcher.start()
        return watcher


def _until(condition, timeout: float = 5.0) -> bool:
    return wait_for(condition, timeout, interval=0.005)


def test_requests_still_in_flight_at_the_deadline_are_ended_once() -> None:
    model = Model(in_flight=3)
    watcher = model.watch(drain_seconds=0.2)
    try:
        time.sleep(0.05)
        assert model.intake_closed is None and not model.ended  # ready: nothing happens
        model.ready = False
        assert _until(lambda: model.intake_closed is not None)
        started = time.monotonic()
        assert _until(lambda: bool(model.ended))
        assert time.monotonic() - started >= 0.15  # they had the drain time first
        assert model.ended == [protocol.UNLOADING_MESSAGE]
        time.sleep(0.1)
        assert model.ended == [protocol.UNLOADING_MESSAGE] and model.intake_closed == protocol.UNLOADING_MESSAGE
    finally:
        watcher.stop()


def test_requests_that_finish_within_the_drain_are_not_ended() -> None:
    model = Model(in_flight=2, ready=False)
    watcher = model.watch(drain_seconds=5.0)
    try:
        assert _until(lambda: model.intake_closed is not None)
        with model.lock:
            model.requests = 0  # they got their FINALs
        watcher._thread.join(2.0)
        assert not watcher._thread.is_alive()
        assert model.ended == []
    finally:
        watcher.stop()


def test_readiness_is_asked_while_idle_only_until_it_answers_and_unknown_is_not_acted_on() -> None:
    model = Model(in_flight=0, ready=None)  # the server has not opened its endpoint yet
    watcher = model.watch(drain_seconds=0.0)
    try:
        assert _until(lambda: model.probes >= 3)
        model.ready = False  # answers: e.g. a stopping server, while idle
        time.sleep(0.1)
        probes = model.probes
        time.sleep(0.1)
        assert model.probes == probes and model.intake_closed is None  # an idle unload goes straight to finalize
        model.ready, model.requests = None, 1  # busy, and Triton could not say
        assert _until(lambda: model.probes > probes)
        time.sleep(0.05)
        assert model.intake_closed is None and model.ended == []
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive()


class _ReadyEndpoint(http.server.BaseHTTPRequestHandler):
    """A local HTTP server answering Triton's model-ready route with the status the test sets."""

    status = 200
    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(type(self).status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_http_readiness_probe_maps_triton_answers() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ReadyEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        probe = drain.HttpReadiness(("127.0.0.1", server.server_address[1]), "llm model", "1")
        for status, answer in ((200, True), (400, False), (503, False), (403, None)):
            _ReadyEndpoint.status = status
            assert probe() is answer, status
        assert _ReadyEndpoint.paths[-1] == "/v2/models/llm%20model/versions/1/ready"
    finally:
        server.shutdown()
        server.server_close()
    assert probe() is False  # it answered before and now refuses: the server is stopping


def test_http_readiness_probe_before_the_server_listens() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: connections are refused
        probe = drain.HttpReadiness(("127.0.0.1", port), "llm", "1")
        assert probe() is None and probe() is None and not probe.answered


def test_unload_drain_for_a_server_without_http_watches_only_the_drain_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(protocol.DRAIN_FILE_ENV, str(tmp_path / "drain"))
    model = Model(in_flight=1)
    watcher = drain.unload_drain_for(
        "m", "1", TritonCommand(12.0, None, "none"), None, model.in_flight, model.close_intake, model.end_all
    )
    assert watcher.drain_seconds == 7.0 and watcher._is_ready is None
    assert watcher._drain_file == tmp_path / "drain"
    monkeypatch.delenv(protocol.DRAIN_FILE_ENV)
    unwatched = drain.unload_drain_for("m", "1", None, 2.0, model.in_flight, model.close_intake, model.end_all)
    assert unwatched.drain_seconds == 2.0 and unwatched._drain_file is None


def test_a_drain_request_for_this_server_drains_even_a_ready_model_and_marks_it_done(tmp_path) -> None:
    drain_file = tmp_path / "drain"
    model = Model(in_flight=2, ready=True)
    watcher = model.watch(0.1, drain_file=drain_file)
    try:
        protocol.request_drain(drain_file, os.getppid() + 1)  # another server's request
        time.sleep(0.1)
        assert model.intake_closed is None
        protocol.request_drain(drain_file, os.getppid())  # this instance's server (its parent process)
        marker = protocol.drained_marker(drain_file, os.getpid())
        assert _until(marker.exists)
        assert model.intake_closed == protocol.DRAIN_REQUESTED_MESSAGE
        assert model.ended == [protocol.DRAIN_REQUESTED_MESSAGE] and model.in_flight() == 0
        assert server_drain._drained(drain_file, os.getpid()) == 2  # requests it had when asked
    finally:
        watcher.stop()


def test_a_drain_request_from_before_the_process_started_is_ignored(tmp_path) -> None:
    drain_file = tmp_path / "drain"
    protocol.request_drain(drain_file, os.getppid())
    started = procfs.started_at(os.getpid())
    assert started is not None and started <= time.time()
    os.utime(drain_file, (started - 60, started - 60))  # e.g. left by a restarted container
    model = Model(in_flight=1, ready=True)
    watcher = model.watch(0.0, drain_file=drain_file)
    try:
        time.sleep(0.1)
        assert model.intake_closed is None
        protocol.request_drain(drain_file, os.getppid())  # a drain request now
        assert _until(lambda: model.intake_closed is not None)
    finally:
        watcher.stop()


def test_a_drained_marker_older_than_its_process_is_a_leftover(tmp_path) -> None:
    drain_file = tmp_path / "drain"
    marker = protocol.drained_marker(drain_file, os.getpid())
    assert server_drain._drained(drain_file, os.getpid()) is None
    marker.write_text("3\n")
    assert server_drain._drained(drain_file, os.getpid()) == 3
    started = procfs.started_at(os.getpid())
    os.utime(marker, (started - 60, started - 60))
    assert server_drain._drained(drain_file, os.getpid()) is None


def test_exit_timeout_of_falls_back_to_tritons_default() -> None:
    assert triton_command.exit_timeout_of(None) == 30.0
    assert triton_command.exit_timeout_of(TritonCommand(None, None, "none")) == 30.0  # not a number
    assert triton_command.exit_timeout_of(TritonCommand(12.0, None, "none")) == 12.0


def test_the_process_tree_and_what_runs_in_it() -> None:
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:

        def sleeping() -> list[int]:
            # Until the forked child has exec'd sleep, its command line is still the shell's.
            return [pid for pid in procfs.children(shell.pid) if procfs.cmdline(pid) == ["sleep", "30"]]

        assert wait_for(lambda: len(sleeping()) == 1, timeout=10, interval=0.01)
        (sleeper,) = sleeping()
        assert shell.pid in procfs.children(os.getpid()) and sleeper not in procfs.children(os.getpid())
        below = procfs.descendants(os.getpid())
        assert below.index(shell.pid) < below.index(sleeper)  # parents before children
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    assert not procfs.alive(shell.pid) and procfs.descendants(shell.pid) == []
    assert triton_command.is_tritonserver(["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"])
    assert not triton_command.is_tritonserver(["python", "tritonserver"])
    assert triton_command.is_python_backend_stub(["/b/python/triton_python_backend_stub", "/m/1/model.py", "x"])
    assert not triton_command.is_python_backend_stub([])
