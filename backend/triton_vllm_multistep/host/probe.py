"""`triton-vllm-multistep probe`: a health check that tells the truth about this backend's models.

Owns finding the server to check (procfs, as `drain` does), gathering what it reports (HTTP
model readiness and config, the metrics endpoint, its stub processes) and deciding healthy or
not; must not change the server. Runs inside the server's container (a Kubernetes exec probe):
it needs the server's process table. Never imports vLLM or torch, nor anything that does.

Why not Triton's own health endpoints: after an engine failure /v2/health/live and
/v2/health/ready stay 200 in every model-control mode, /v2/models/<m>/ready turns 400 only in
explicit mode (the model unloads itself), and a dead stub keeps every endpoint at 200. So a
model is healthy only if all of these hold (docs/scaling-out.md has the table):
- the server answers /v2/health/live, and the model answers /v2/models/<m>/ready with 200;
- its `vllm_multistep:engine_alive` series (when exported) are all 1: catches a failed engine
  where the model stays loaded (default/poll mode, or unload_on_engine_failure false);
- as many live stub processes run it as its instance groups ask for: catches a killed or
  crashed stub, which Triton does not notice until a request reaches it;
- each of its instances' heartbeat (`vllm_multistep:heartbeat_timestamp_seconds`, set by the
  stub's response thread through tritonserver every second, stub/heartbeat.py) is at most
  HEARTBEAT_STALE_SECONDS old: catches a stub or a tritonserver Python backend that is alive but
  stuck (a stopped process, a wedged IPC thread after a crash inside tritonserver), which every
  other signal here reports healthy.
With --readiness, a server asked to drain (its drain file names it) is not ready either.
Each answer costs a few local HTTP calls and a /proc scan; nothing enters the engine's queue,
so a busy pod is never reported dead for being busy.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton_vllm_multistep.host.launcher import BACKEND_NAME
from triton_vllm_multistep.lifecycle import procfs, server_drain, triton_command
from triton_vllm_multistep.lifecycle.protocol import (
    CLOCK_SLACK_SECONDS,
    DRAIN_FILE_ENV,
    HEARTBEAT_METRIC,
    HEARTBEAT_STALE_SECONDS,
)

ENGINE_ALIVE_METRIC = "vllm_multistep:engine_alive"
TRITON_DEFAULT_METRICS_PORT = 8002
# Within the manifests' exec-probe timeoutSeconds (4 s and more), process start included.
DEFAULT_TIMEOUT_SECONDS = 3.0
MIN_TIMEOUT_SECONDS = 0.5  # what the checks get however long the start-up took


class ProbeError(RuntimeError):
    """The probe cannot find or reach what it should check (itself an unhealthy answer)."""


@dataclass(frozen=True)
class ModelHealth:
    """What the server reports about one model, gathered by `gather`."""

    name: str
    ready: bool
    backend: str | None = None  # from its config; None when not loaded
    expected_stubs: int = 0  # this backend's models: stub processes its instance groups ask for
    live_stubs: int = 0
    engine_alive: list[float] = field(default_factory=list)  # every engine_alive series of the model
    heartbeats: dict[str, float] = field(default_factory=dict)  # instance → its heartbeat (Unix time)


@dataclass(frozen=True)
class ServerHealth:
    live: bool
    models: list[ModelHealth]
    draining: bool = False
    metrics_read_at: float = 0.0  # time.time() when the metrics were read (heartbeat ages are from it)


def problems(health: ServerHealth, readiness: bool = False) -> list[str]:
    """Why the server is unhealthy (empty: healthy); with `readiness`, a drain counts too."""
    if not health.live:
        return ["tritonserver does not answer /v2/health/live"]
    found = []
    if readiness and health.draining:
        found.append("the server is draining (asked to stop): not taking new requests")
    if not health.models:
        found.append("no model to check")
    for model in health.models:
        if not model.ready:
            found.append(f"model {model.name} is not ready")
            continue
        if model.backend != BACKEND_NAME:
            continue
        if any(value != 1 for value in model.engine_alive):
            found.append(f"model {model.name}: its vLLM engine has failed ({ENGINE_ALIVE_METRIC} 0)")
        for instance, beat in sorted(model.heartbeats.items()):
            age = health.metrics_read_at - beat
            if age > HEARTBEAT_STALE_SECONDS:
                found.append(
                    f"model {model.name}: instance {instance} last reached tritonserver {age:.1f} s ago "
                    f"({HEARTBEAT_METRIC}; stale after {HEARTBEAT_STALE_SECONDS:.0f} s): its stub or tritonserver's "
                    "Python backend is stuck"
                )
        if model.live_stubs < model.expected_stubs:
            found.append(
                f"model {model.name}: {model.live_stubs} of {model.expected_stubs} stub process(es) running "
                "(a stub died)"
            )
    return found


def expected_stubs(config: dict[str, Any]) -> int:
    """Stub processes a Python-based model runs: one per instance (per GPU listed for KIND_GPU groups)."""
    total = 0
    for group in config.get("instance_group") or [{"count": 1}]:
        count = int(group.get("count", 1))
        gpus = group.get("gpus") or []
        total += count * max(1, len(gpus)) if group.get("kind") == "KIND_GPU" else count
    return total


def metric_values(text: str, name: str, model: str) -> list[float]:
    """The values of every series `name` with label model="<model>" in Prometheus text."""
    values = []
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))).get("model") == model:
            values.append(float(match.group(2)))
    return values


def heartbeat_values(text: str, model: str) -> dict[str, float]:
    """Instance → heartbeat value of every HEARTBEAT_METRIC series of `model` in Prometheus text."""
    beats = {}
    for match in re.finditer(rf"^{re.escape(HEARTBEAT_METRIC)}\{{([^}}]*)\}} (\S+)", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("model") == model:
            beats[labels.get("instance", "")] = float(match.group(2))
    return beats


def find_server(drain_file: str | None) -> int:
    """The tritonserver to check: the one whose drain file is ours (the container's), else the only one."""
    if drain_file:
        servers = server_drain.tritonserver_pids(Path(drain_file))
        where = f" with {DRAIN_FILE_ENV}={drain_file}"
    else:
        servers = [pid for pid in procfs.pids() if triton_command.of_process(pid) is not None]
        where = ""
    if not servers:
        raise ProbeError(f"no running tritonserver{where}")
    if len(servers) > 1:
        raise ProbeError(f"{len(servers)} tritonservers{where} ({servers}): set {DRAIN_FILE_ENV} to tell them apart")
    return servers[0]


def metrics_url(argv: Sequence[str]) -> str | None:
    """The server's metrics endpoint from its command line (Triton's defaults where absent); None: off."""

    def last(name: str, default: str) -> str:
        values = triton_command.option_values(argv, name)
        return values[-1] if values else default

    if last("--allow-metrics", "true").strip().lower() in ("false", "0", "no", "off"):
        return None
    address = last("--metrics-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "[::]": "[::1]"}.get(address, address)
    return f"http://{host}:{last('--metrics-port', str(TRITON_DEFAULT_METRICS_PORT))}/metrics"


def model_names(argv: Sequence[str], index: list[dict[str, Any]]) -> list[str]:
    """The models that must be healthy: explicit mode's --load-model names, else every model in the repository.

    A model that failed and unloaded itself stays on the list (its readiness then fails)."""
    command = triton_command.parse(argv)
    loaded = [name for name in triton_command.option_values(argv, "--load-model") if name != "*"]
    if command is not None and command.model_control_mode == "explicit" and loaded:
        return list(dict.fromkeys(loaded))
    return list(dict.fromkeys(entry["name"] for entry in index))


def draining(server_pid: int, drain_file: str | None) -> bool:
    """Whether the server has been asked to drain (protocol.request_drain), since it started."""
    if not drain_file:
        return False
    path = Path(drain_file)
    try:
        lines = path.read_text().split()
        written = path.stat().st_mtime
    except OSError:
        return False
    started = procfs.started_at(server_pid)
    recent = started is None or written >= started - CLOCK_SLACK_SECONDS
    return recent and str(server_pid) in lines


class _Http:
    """Plain-HTTP GET/POST on the server's endpoints within one overall deadline."""

    def __init__(self, base: str, timeout: float) -> None:
        self.base = base
        self.deadline = time.monotonic() + timeout

    def call(self, path: str, body: bytes | None = None, base: str | None = None) -> tuple[int, bytes]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ProbeError("the server did not answer within the probe's timeout")
        request = urllib.request.Request((base or self.base) + path, data=body, method="POST" if body else "GET")
        try:
            with urllib.request.urlopen(request, timeout=remaining) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except (urllib.error.URLError, OSError) as error:
            raise ProbeError(f"{(base or self.base) + path}: {getattr(error, 'reason', error)}") from error


def gather(
    server_pid: int, drain_file: str | None, models: Sequence[str] = (), timeout: float = DEFAULT_TIMEOUT_SECONDS
) -> ServerHealth:
    """Ask server `server_pid` (over its own HTTP and metrics endpoints) how its models are."""
    argv = procfs.cmdline(server_pid)
    command = triton_command.parse(argv)
    if command is None or command.http_endpoint is None:
        raise ProbeError(f"tritonserver {server_pid} has no HTTP endpoint (--allow-http=false) to probe")
    host, port = command.http_endpoint
    http = _Http(f"http://{'[' + host + ']' if ':' in host else host}:{port}", timeout)
    status, _ = http.call("/v2/health/live")
    if status != 200:
        return ServerHealth(live=False, models=[])
    names = list(models)
    if not names:
        _, index = http.call("/v2/repository/index", body=b"{}")
        names = model_names(argv, json.loads(index or b"[]"))
    stubs: dict[str, int] = {}
    for pid in server_drain.backend_stub_pids(server_pid, BACKEND_NAME):
        name = server_drain.stub_model_name(pid)
        if name is not None:
            stubs[name] = stubs.get(name, 0) + 1
    url = metrics_url(argv)
    metrics = http.call("", base=url)[1].decode(errors="replace") if url else ""
    metrics_read_at = time.time()
    found = []
    for name in names:
        status, _ = http.call(f"/v2/models/{name}/ready")
        if status != 200:
            found.append(ModelHealth(name, ready=False))
            continue
        status, body = http.call(f"/v2/models/{name}/config")
        config = json.loads(body) if status == 200 else {}
        backend = config.get("backend")
        found.append(
            ModelHealth(
                name,
                ready=True,
                backend=backend,
                expected_stubs=expected_stubs(config) if backend == BACKEND_NAME else 0,
                live_stubs=stubs.get(name, 0),
                engine_alive=metric_values(metrics, ENGINE_ALIVE_METRIC, name),
                heartbeats=heartbeat_values(metrics, name),
            )
        )
    return ServerHealth(
        live=True, models=found, draining=draining(server_pid, drain_file), metrics_read_at=metrics_read_at
    )


def run(drain_file: str | None, models: Sequence[str], readiness: bool, timeout: float) -> tuple[bool, list[str]]:
    """Probe the container's tritonserver: (healthy, what is wrong or what was checked)."""
    try:
        server = find_server(drain_file)
        health = gather(server, drain_file, models, timeout)
    except ProbeError as error:
        return False, [str(error)]
    found = problems(health, readiness)
    if found:
        return False, found
    checked = ", ".join(m.name for m in health.models)
    return True, [f"tritonserver {server}: healthy ({checked})"]
