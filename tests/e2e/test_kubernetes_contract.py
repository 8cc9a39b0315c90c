"""The Kubernetes manifests' contract, through a real tritonserver started as the CPU overlay's container.

No cluster runs here, so the pod is played locally: tritonserver runs with exactly the rendered
Deployment's container arguments and environment, except the model repository (a copy of the
shipped LLM model on the tiny demo model), the ports and the drain file (free local ones), plus
the backend directory the image has in /opt/tritonserver/backends. The probes' and the preStop
hook's commands run exactly as written, with the container's environment, as the kubelet would.
Checked: the probe commands pass on a healthy server and fail within their period after an engine
failure (the manifest's explicit model control, and the default mode, where the model stays READY)
or a killed stub; the preStop drain ends every stream in flight (completed or UNAVAILABLE)
and the server exits before the grace period; the HPA's series is on the metrics endpoint with the
labels the adapter rule selects.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml
from private_servers import make_repository, model_ready, scrape, stub_processes, unloads, wait_for
from triton_clients import StreamResult, grpc_generate

from triton_vllm_multistep.host import launcher
from triton_vllm_multistep.lifecycle import triton_command
from triton_vllm_multistep.lifecycle.protocol import DRAIN_FILE_ENV, HEARTBEAT_STALE_SECONDS
from triton_vllm_multistep.testing import kustomize
from triton_vllm_multistep.testing.faults import server_environment
from triton_vllm_multistep.testing.local_server import ServerProcess, free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
DOCUMENTS = kustomize.render(DEPLOY / "overlays" / "cpu")
DEPLOYMENT = kustomize.find(DOCUMENTS, "Deployment")
(CONTAINER,) = DEPLOYMENT["spec"]["template"]["spec"]["containers"]
GRACE_SECONDS = DEPLOYMENT["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
(MODEL,) = triton_command.option_values(CONTAINER["args"], "--load-model")
SHORT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
LONG = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}
MEDIUM = {"temperature": 0, "max_tokens": 50, "ignore_eos": True}
# The demo model's longest: more than the drain's 25 s allow on a busy host, maybe not on a quiet one.
ENDLESS = {"temperature": 0, "max_tokens": 2000, "ignore_eos": True}
PRESTOP_STREAMS = (MEDIUM, MEDIUM, ENDLESS, ENDLESS, ENDLESS, ENDLESS, ENDLESS, ENDLESS)
STOPPING = "the server is about to stop"


class Pod:
    """tritonserver started as the container would be, and the container's exec commands."""

    def __init__(
        self,
        root: Path,
        extra_env: dict[str, str] | None = None,
        engine: dict | None = None,
        drop_options: tuple[str, ...] = (),
    ) -> None:
        """`drop_options`: manifest options left out (another model-control mode than the manifest's)."""
        repository = make_repository(root, {MODEL: {"engine": engine or {}}})
        self.drain_file = root / "drain-request"
        http_port, grpc_port, metrics_port = free_ports(3)
        replaced = {
            "--model-repository": str(repository),
            "--http-port": str(http_port),
            "--grpc-port": str(grpc_port),
            "--metrics-port": str(metrics_port),
        }
        args = []
        for arg in CONTAINER["args"]:
            name = arg.split("=", 1)[0]
            if name in drop_options:
                continue
            assert "=" in arg or name not in replaced, f"write {name} as {name}=value in the manifest"
            args.append(f"{name}={replaced[name]}" if name in replaced else arg)
        install = launcher.find_triton()
        backend_dir = launcher.prepare_backend_dir(install, root / "backends")
        self.command = launcher.build_command(install, backend_dir, args)
        manifest_env = {e["name"]: e["value"] for e in CONTAINER["env"]}
        manifest_env[DRAIN_FILE_ENV] = str(self.drain_file)
        manifest_env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # a shared CI host, not a 16 GiB pod
        self.env = launcher.server_environment(install) | manifest_env | (extra_env or {})
        self.log_path = root / "tritonserver.log"
        with self.log_path.open("w") as log:
            process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.server = ServerProcess(process, http_port, grpc_port, metrics_port, self.log_path)

    def exec(self, command: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run an exec probe or hook command as the kubelet does: in the container's environment."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)

    def probe(self, name: str) -> subprocess.CompletedProcess:
        spec = CONTAINER[name]
        return self.exec(spec["exec"]["command"], timeout=spec["timeoutSeconds"])

    def stop(self) -> None:
        self.server.stop(timeout=GRACE_SECONDS)
        try:
            os.killpg(self.server.process.pid, signal.SIGKILL)  # anything left of its session
        except ProcessLookupError:
            pass


def _probe_budget(name: str) -> float:
    """How long the kubelet takes to act on a failure: periodSeconds × failureThreshold, + one probe's run."""
    spec = CONTAINER[name]
    return spec["periodSeconds"] * spec.get("failureThreshold", 3) + spec["timeoutSeconds"]


def _fails_within(pod: Pod, name: str) -> subprocess.CompletedProcess | None:
    """The first failing run of probe `name`, polled as often as the kubelet may, within its budget; None: passed."""
    failed: list[subprocess.CompletedProcess] = []

    def probe_fails() -> bool:
        result = pod.probe(name)
        if result.returncode != 0:
            failed.append(result)
        return bool(failed)

    wait_for(probe_fails, timeout=_probe_budget(name), interval=0)
    return failed[0] if failed else None


def _stream(pod: Pod, sampling: dict, results: list, started: threading.Event, timeout: float = 300) -> None:
    try:
        results.append(
            grpc_generate(
                pod.server.grpc_url,
                MODEL,
                prompt="a stream",
                sampling=sampling,
                stream=True,
                timeout=timeout,
                on_response=started.set,
            )
        )
    except BaseException as error:  # a hang shows up as TimeoutError
        results.append(error)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory, demo_model_paths: dict) -> Iterator[Pod]:
    """A pod with the test-only engine fault armed (its file absent: the engine runs normally)."""
    root = tmp_path_factory.mktemp("kubernetes-pod")
    handle = Pod(root, server_environment(root / "engine-fault"))
    handle.fault_file = root / "engine-fault"  # type: ignore[attr-defined]
    try:
        handle.server.wait_ready(timeout=600)
        yield handle
    finally:
        handle.stop()


def test_probe_paths_and_ports_answer_on_a_healthy_pod(pod: Pod) -> None:
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        result = pod.probe(name)
        assert result.returncode == 0, (name, result.stdout, result.stderr)
        assert f"healthy ({MODEL})" in result.stdout
    assert requests.get(f"{pod.server.http_url}/v2/health/live", timeout=10).status_code == 200
    client = grpcclient.InferenceServerClient(pod.server.grpc_url)
    try:
        assert client.is_server_live() and client.is_model_ready(MODEL)
    finally:
        client.close()
    answer = grpc_generate(pod.server.grpc_url, MODEL, prompt="hello", sampling=SHORT, stream=True)
    assert answer.finals == 1 and answer.error is None and len(answer.token_ids()) == 4


def test_the_hpa_series_is_on_the_metrics_endpoint_with_the_labels_the_adapter_rule_selects(pod: Pod) -> None:
    config_map = kustomize.find(kustomize.render(DEPLOY / "monitoring"), "ConfigMap")
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    name, matchers = re.fullmatch(r"([\w:]+)\{(.*)\}", rule["seriesQuery"]).groups()
    added_by_scrape = set(rule["resources"]["overrides"])  # namespace, pod: Prometheus adds them
    series = [
        dict(re.findall(r'(\w+)="([^"]*)"', labels))
        for labels in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} \S+$", scrape(pod.server), re.M)
    ]
    assert series, f"no {name} series on {pod.server.metrics_url}"
    checked = 0
    for matcher in matchers.split(","):
        label, operator, value = re.fullmatch(r'(\w+)(!=|=)"(.*)"', matcher.strip()).groups()
        if label in added_by_scrape:
            continue
        checked += 1
        selected = [s for s in series if (s.get(label, "") == value) == (operator == "=")]
        assert selected, (matcher, series)
    assert checked and {s.get("model") for s in series} == {MODEL}


def test_engine_failure_fails_the_readiness_and_liveness_probes_within_their_period(pod: Pod) -> None:
    fault_file: Path = pod.fault_file  # type: ignore[attr-defined]
    results: list[Any] = []
    started = threading.Event()
    thread = threading.Thread(target=_stream, args=(pod, LONG, results, started), daemon=True)
    thread.start()
    assert started.wait(60)
    unloads_before = unloads(pod.server, MODEL)
    fault_file.touch()
    try:
        thread.join(60)
        assert not thread.is_alive()
        assert isinstance(results[0], StreamResult) and "vLLM engine failed" in (results[0].error or "")
        for name in ("readinessProbe", "livenessProbe"):
            failed = _fails_within(pod, name)
            assert failed is not None, f"{name} still passes after the engine failed"
            assert MODEL in failed.stderr, failed.stderr
    finally:
        fault_file.unlink(missing_ok=True)
    # Explicit model control: the model unloaded itself; an operator (here: the test) reloads it once the
    # unload is done (not ready comes first: a load while the old stub still ended once aborted
    # tritonserver 2.51 with boost::interprocess::lock_exception, a fresh-clone run here).
    assert wait_for(lambda: not model_ready(pod.server, MODEL), timeout=60)
    assert wait_for(lambda: unloads(pod.server, MODEL) > unloads_before, timeout=60)
    client = grpcclient.InferenceServerClient(pod.server.grpc_url)
    try:
        client.load_model(MODEL)
    finally:
        client.close()
    assert pod.probe("readinessProbe").returncode == 0


def test_a_stopped_stub_or_server_fails_the_probe_within_one_readiness_period(pod: Pod) -> None:
    """SIGSTOP: every process stays alive, so Triton's endpoints (and the stub count) say healthy; the
    instance's heartbeat stops (a stopped stub), or the server stops answering (a stopped server)."""
    if pod.probe("readinessProbe").returncode != 0:  # an earlier test failed half-way: a fresh stub
        grpcclient.InferenceServerClient(pod.server.grpc_url).load_model(MODEL)
    assert wait_for(lambda: pod.probe("readinessProbe").returncode == 0, timeout=60)
    period = CONTAINER["readinessProbe"]["periodSeconds"]
    assert HEARTBEAT_STALE_SECONDS + 0.5 < period  # the check below runs within one period of the stop
    (stub,) = stub_processes(pod.server)
    tritonserver = psutil.Process(pod.server.process.pid)
    for stopped, expected in ((stub, ("last reached tritonserver",)), (tritonserver, ("did not answer", "timed out"))):
        stopped.suspend()
        try:
            stopped_at = time.monotonic()
            if stopped is stub:
                assert requests.get(f"{pod.server.http_url}/v2/models/{MODEL}/ready", timeout=10).status_code == 200
            time.sleep(max(0.0, stopped_at + HEARTBEAT_STALE_SECONDS + 0.5 - time.monotonic()))
            result = pod.probe("readinessProbe")  # started within one period of the stop
            assert result.returncode != 0, f"the probe passes with {stopped.name()} stopped: {result.stdout}"
            assert any(text in result.stderr for text in expected), result.stderr
        finally:
            stopped.resume()
        assert wait_for(lambda: pod.probe("readinessProbe").returncode == 0, timeout=60), "healthy again once resumed"


def test_a_killed_stub_fails_the_probe_within_its_period(pod: Pod) -> None:
    """Every Triton endpoint stays 200 with the stub dead; the probe counts the stub processes."""
    if not model_ready(pod.server, MODEL):  # the previous test failed half-way
        grpcclient.InferenceServerClient(pod.server.grpc_url).load_model(MODEL)
    assert pod.probe("livenessProbe").returncode == 0
    (stub,) = stub_processes(pod.server)
    stub.kill()  # tritonserver's child: it reaps it (or leaves a zombie, which counts as dead)
    assert requests.get(f"{pod.server.http_url}/v2/models/{MODEL}/ready", timeout=10).status_code == 200
    for name in ("readinessProbe", "livenessProbe"):
        failed = _fails_within(pod, name)
        assert failed is not None, f"{name} still passes with the stub dead"
        assert "0 of 1 stub process(es) running" in failed.stderr, failed.stderr


def test_engine_failure_in_the_default_model_control_mode_fails_the_probe(
    tmp_path: Path, demo_model_paths: dict
) -> None:
    """Without explicit model control a failed model stays loaded and READY (every request fails):
    the probe reads the engine's own gauge. The same container otherwise."""
    fault_file = tmp_path / "engine-fault"
    pod = Pod(tmp_path, server_environment(fault_file), drop_options=("--model-control-mode", "--load-model"))
    try:
        pod.server.wait_ready(timeout=600)
        assert triton_command.parse(pod.command).model_control_mode == "none"
        assert pod.probe("livenessProbe").returncode == 0
        fault_file.touch()
        failed = grpc_generate(pod.server.grpc_url, MODEL, prompt="fail", sampling=SHORT, stream=True, timeout=60)
        assert failed.error is not None and "vLLM engine failed" in failed.error
        for name in ("readinessProbe", "livenessProbe"):
            result = _fails_within(pod, name)
            assert result is not None, f"{name} still passes after the engine failed"
            assert "its vLLM engine has failed" in result.stderr, result.stderr
        assert model_ready(pod.server, MODEL)  # what an httpGet probe would have seen
    finally:
        pod.stop()


def test_prestop_drains_streams_in_flight_and_the_server_exits_within_the_grace_period(
    tmp_path: Path, demo_model_paths: dict
) -> None:
    """The kubelet's order: preStop (run exactly as written) to completion, then SIGTERM to the
    container's PID 1 (tritonserver), SIGKILL at terminationGracePeriodSeconds from preStop's start."""
    pod = Pod(tmp_path, engine={"max_model_len": 2048})
    try:
        pod.server.wait_ready(timeout=600)
        streams: list[tuple[threading.Thread, list, threading.Event]] = []
        for sampling in PRESTOP_STREAMS:
            results: list[Any] = []
            started = threading.Event()
            thread = threading.Thread(target=_stream, args=(pod, sampling, results, started, GRACE_SECONDS + 60))
            thread.start()
            streams.append((thread, results, started))
        assert all(started.wait(120) for _, _, started in streams)
        stubs = stub_processes(pod.server)
        began = time.monotonic()
        prestop = pod.exec(CONTAINER["lifecycle"]["preStop"]["exec"]["command"], timeout=GRACE_SECONDS)
        assert prestop.returncode == 0, (prestop.stdout, prestop.stderr)
        assert "1 vllm_multistep model instance(s), 1 drained" in prestop.stdout
        # Drained: out of the Service (readiness) but not restarted (liveness).
        readiness = pod.probe("readinessProbe")
        assert readiness.returncode == 1 and "draining" in readiness.stderr, readiness.stderr
        assert pod.probe("livenessProbe").returncode == 0
        pod.server.process.send_signal(signal.SIGTERM)
        code = pod.server.process.wait(max(1.0, GRACE_SECONDS - (time.monotonic() - began)))
        took = time.monotonic() - began
        print(f"preStop start to exit: {took:.1f} s (grace period {GRACE_SECONDS} s)")
        for thread, _, _ in streams:
            thread.join(60)
        assert not any(thread.is_alive() for thread, _, _ in streams), "a client still waits: a stream hangs"
    finally:
        pod.stop()
    assert code == 0, pod.server.log_tail()
    assert took < GRACE_SECONDS
    outcomes = []
    for (_, results, _), sampling in zip(streams, PRESTOP_STREAMS, strict=True):
        (result,) = results
        assert isinstance(result, StreamResult), result
        assert result.finals == 1, (result.finals, result.error)
        if result.error is None:
            assert len(result.token_ids()) == sampling["max_tokens"]
            outcomes.append("completed")
        else:
            # The drain's UNAVAILABLE error (the gRPC stream carries its message, not its code).
            assert STOPPING in result.error, result.error
            outcomes.append("ended UNAVAILABLE")
    print(f"streams: {outcomes}")
    log = pod.log_path.read_text(errors="replace")
    assert "Exit timeout expired" not in log
    time.sleep(0.5)
    assert not [p for p in stubs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "a stub outlived the server"
