"""deploy/kubernetes without a cluster: schema validation, lint, wiring, grace-period arithmetic, probe logic.

Core resources (every file and both rendered overlays) are validated strictly against Kubernetes
KUBERNETES_VERSION's schemas (kubernetes-validate); the ServiceMonitor CRD, which that package
has no schema for, against deploy/kubernetes/schemas/servicemonitor-v1.json (a closed subset of
the CRD's schema); the prometheus-adapter rule (inside a ConfigMap) by what it must select.
Overlays are rendered by testing/kustomize.py (kustomize's semantics for the features used).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter

from triton_vllm_multistep.host import cli, kubernetes, probe
from triton_vllm_multistep.lifecycle import triton_command
from triton_vllm_multistep.lifecycle.protocol import (
    DRAIN_FILE_ENV,
    EXIT_GRACE_SECONDS,
    HEARTBEAT_METRIC,
    HEARTBEAT_STALE_SECONDS,
    SETTLE_SECONDS,
)
from triton_vllm_multistep.testing import kustomize

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ["gpu", "cpu"]
KUBERNETES_VERSION = "1.32.0"  # the newest kubernetes-validate 1.32.0 knows
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): DEPLOY / "schemas" / "servicemonitor-v1.json"}
PATCH_FILES = {DEPLOY / "overlays" / "gpu" / "gpu-node-pool.yaml", DEPLOY / "overlays" / "cpu" / "cpu-node-pool.yaml"}


def _resource_files() -> list[Path]:
    """Every manifest that is a whole resource (kustomizations and partial patches excluded)."""
    return sorted(
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.name not in ("kustomization.yaml", ".yamllint.yaml") and p not in PATCH_FILES
    )


def _rendered(overlay: str) -> list[dict[str, Any]]:
    return kustomize.render(DEPLOY / "overlays" / overlay)


def _container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = kustomize.find(documents, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _validate(document: dict[str, Any]) -> None:
    schema = CRD_SCHEMAS.get((document["apiVersion"], document["kind"]))
    if schema is not None:
        jsonschema.validate(document, json.loads(schema.read_text()))
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def _adapter_rule() -> dict[str, Any]:
    config_map = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter-config.yaml").read_text())
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rule


# --- validation and lint ---------------------------------------------------------------------


def test_every_yaml_file_passes_yamllint() -> None:
    settings = yamllint_config.YamlLintConfig(file=str(DEPLOY / ".yamllint.yaml"))
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 12
    for path in files:
        found = [f"{path}:{p.line}: {p.message}" for p in linter.run(path.read_text(), settings)]
        assert not found, found


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_passes_strict_schema_validation(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents
    for document in documents:
        _validate(document)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_passes_strict_schema_validation(overlay: str) -> None:
    documents = _rendered(overlay) + kustomize.render(DEPLOY / "monitoring")
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == sorted(
        ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap"]
    )
    for document in documents:
        _validate(document)


def test_validation_catches_a_misspelt_field() -> None:
    """Strict means strict: an unknown field fails, in core resources and in the vendored CRD schema alike."""
    deployment = kustomize.find(_rendered("cpu"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        _validate(deployment)
    monitor = kustomize.find(kustomize.render(DEPLOY / "monitoring"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        _validate(monitor)


# --- the overlays ----------------------------------------------------------------------------


def test_gpu_overlay_requests_a_gpu_and_cpu_overlay_selects_the_cpu_configs() -> None:
    gpu, cpu = _container(_rendered("gpu")), _container(_rendered("cpu"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--model-config-name=cpu" not in gpu["args"]
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])
    assert cpu["args"][-1] == "--model-config-name=cpu"
    assert cpu["args"][:-1] == gpu["args"]  # the same server otherwise
    assert {e["name"] for e in cpu["env"]} == {DRAIN_FILE_ENV, "VLLM_USE_V1", "VLLM_CPU_KVCACHE_SPACE"}
    assert gpu["image"] == "registry.example.com/triton-vllm-multistep:0.1.0"


def test_deployment_uses_explicit_model_control_and_serves_on_the_service_ports() -> None:
    documents = _rendered("gpu")
    container = _container(documents)
    command = triton_command.parse(["tritonserver", *container["args"]])
    assert command is not None and command.model_control_mode == "explicit"
    assert triton_command.option_values(container["args"], "--load-model") == ["vllm_model"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert command.http_endpoint == ("127.0.0.1", ports["http"])
    assert triton_command.option_values(container["args"], "--grpc-port") == [str(ports["grpc"])]
    assert probe.metrics_url(container["args"]) == f"http://127.0.0.1:{ports['metrics']}/metrics"
    service = kustomize.find(documents, "Service")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in ("http", "grpc", "metrics")}
    pod_labels = kustomize.find(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        selector = kustomize.find(documents, kind)["spec"]["selector"]
        assert (selector.get("matchLabels") or selector).items() <= pod_labels.items(), kind
    hpa = kustomize.find(documents, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == kustomize.find(documents, "Deployment")["metadata"]["name"]


def test_image_sets_the_same_drain_file_as_the_manifest() -> None:
    container = _container(_rendered("gpu"))
    value = next(e["value"] for e in container["env"] if e["name"] == DRAIN_FILE_ENV)
    assert f"{DRAIN_FILE_ENV}={value}" in (REPO_ROOT / "docker" / "Dockerfile").read_text()


def test_probes_and_prestop_run_this_projects_commands() -> None:
    container = _container(_rendered("gpu"))
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["triton-vllm-multistep", "drain"]
    assert container["readinessProbe"]["exec"]["command"] == ["triton-vllm-multistep", "probe", "--readiness"]
    for name in ("startupProbe", "livenessProbe"):
        assert container[name]["exec"]["command"] == ["triton-vllm-multistep", "probe"]
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The probe's own deadline, plus a Python start, fits in the kubelet's.
        assert container[name]["timeoutSeconds"] >= probe.DEFAULT_TIMEOUT_SECONDS + 1, name


# --- grace period ----------------------------------------------------------------------------


def test_minimum_grace_period_adds_drain_settle_exit_timeout_and_exit_grace() -> None:
    assert kubernetes.minimum_grace_period(30) == 30 + SETTLE_SECONDS + 30 + EXIT_GRACE_SECONDS
    assert kubernetes.minimum_grace_period(30, drain_timeout=10) == 10 + SETTLE_SECONDS + 30 + EXIT_GRACE_SECONDS
    assert kubernetes.minimum_grace_period(7.4) == 31  # 30.8, rounded up to whole seconds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_period_covers_drain_and_exit_for_the_manifests_exit_timeout(overlay: str) -> None:
    deployment = kustomize.find(_rendered(overlay), "Deployment")
    container = _container([deployment])
    exit_timeout = triton_command.exit_timeout_of(triton_command.parse(["tritonserver", *container["args"]]))
    assert triton_command.option_values(container["args"], "--exit-timeout-secs") == ["30"]  # said, not defaulted
    prestop = container["lifecycle"]["preStop"]["exec"]["command"]
    drain_timeout = float(prestop[prestop.index("--timeout") + 1]) if "--timeout" in prestop else None
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= kubernetes.minimum_grace_period(exit_timeout, drain_timeout), grace


# --- autoscaling -----------------------------------------------------------------------------


def test_hpa_metric_is_the_adapter_rules_rename_of_the_backends_queue_gauge() -> None:
    rule = _adapter_rule()
    series = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}", rule["seriesQuery"].strip())
    assert series is not None
    assert series.group(1) == "vllm:num_requests_waiting"
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"], series.group(1))
    assert ":" not in renamed  # custom metrics API names cannot hold ":"
    (metric,) = kustomize.find(_rendered("gpu"), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == renamed
    assert metric["pods"]["target"]["type"] == "AverageValue"
    # The rule maps the labels a Prometheus scrape adds to the pod and its namespace.
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert {"namespace", "pod"} <= {m.split("!=")[0].split("=")[0] for m in series.group(2).split(",")}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_servicemonitor_scrapes_the_services_metrics_port_and_pods_are_annotated() -> None:
    documents = _rendered("gpu")
    monitor = kustomize.find(kustomize.render(DEPLOY / "monitoring"), "ServiceMonitor")
    service = kustomize.find(documents, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    annotations = kustomize.find(documents, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in _container(documents)["ports"]}
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


# --- the renderer ----------------------------------------------------------------------------


def test_strategic_merge_merges_named_lists_and_replaces_others() -> None:
    original = {
        "containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["--p"]}],
        "tolerations": [{"key": "t1"}],
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["--q"]}, {"name": "b"}],
        "tolerations": [{"key": "t2"}],
    }
    merged = kustomize.strategic_merge(original, patch)
    assert merged["containers"][0]["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]
    assert merged["containers"][0]["args"] == ["--q"]
    assert [c["name"] for c in merged["containers"]] == ["a", "b"]
    assert merged["tolerations"] == [{"key": "t2"}]
    assert original["containers"][0]["args"] == ["--p"]  # not modified in place


def test_renderer_refuses_kustomization_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize.KustomizeError, match="namePrefix"):
        kustomize.render(tmp_path)


# --- the probe's decision --------------------------------------------------------------------


def _model(**overrides: Any) -> probe.ModelHealth:
    fields: dict[str, Any] = {
        "name": "vllm_model",
        "ready": True,
        "backend": "vllm_multistep",
        "expected_stubs": 1,
        "live_stubs": 1,
        "engine_alive": [1.0],
    }
    return probe.ModelHealth(**(fields | overrides))


def test_probe_healthy_when_every_check_holds() -> None:
    health = probe.ServerHealth(live=True, models=[_model(), _model(name="ensemble", backend=None)])
    assert probe.problems(health) == [] and probe.problems(health, readiness=True) == []


@pytest.mark.parametrize(
    ("case", "model", "reason"),
    [
        # explicit model control: the failed model unloads itself
        ("engine failed, explicit mode", _model(ready=False, backend=None), "is not ready"),
        # default/poll mode (or unload_on_engine_failure false): ready stays 200, the gauge says 0
        ("engine failed, model stays loaded", _model(engine_alive=[0.0]), "engine has failed"),
        # a killed stub: every Triton endpoint stays 200
        ("stub dead", _model(live_stubs=0), "0 of 1 stub process(es)"),
        ("one of two GPU instances dead", _model(expected_stubs=2, live_stubs=1), "1 of 2"),
    ],
)
def test_probe_reports_each_failure(case: str, model: probe.ModelHealth, reason: str) -> None:
    found = probe.problems(probe.ServerHealth(live=True, models=[model]))
    assert len(found) == 1 and reason in found[0], (case, found)


def test_probe_reports_a_heartbeat_older_than_its_bound_and_names_the_instance() -> None:
    """A stopped stub, or a Python backend wedged inside tritonserver: every other signal says healthy."""
    now = 1_800_000_000.0
    fresh = probe.ServerHealth(live=True, models=[_model(heartbeats={"m_0_0": now - 1.0})], metrics_read_at=now)
    assert probe.problems(fresh) == []
    stale = probe.ServerHealth(
        live=True,
        models=[_model(heartbeats={"m_0_0": now - 1.0, "m_0_1": now - HEARTBEAT_STALE_SECONDS - 0.5})],
        metrics_read_at=now,
    )
    (found,) = probe.problems(stale)
    assert "instance m_0_1" in found and "4.5 s ago" in found and "stuck" in found


def test_probe_reads_each_instances_heartbeat_of_the_model() -> None:
    text = (
        f'{HEARTBEAT_METRIC}{{instance="m_0_0",model="m",version="1"}} 1800000000.5\n'
        f'{HEARTBEAT_METRIC}{{instance="m_0_1",model="m",version="1"}} 1800000001\n'
        f'{HEARTBEAT_METRIC}{{instance="other_0_0",model="other",version="1"}} 5\n'
    )
    assert probe.heartbeat_values(text, "m") == {"m_0_0": 1800000000.5, "m_0_1": 1800000001.0}
    assert probe.heartbeat_values(text, "absent") == {}


def test_probe_reports_a_dead_server_and_no_models() -> None:
    assert probe.problems(probe.ServerHealth(live=False, models=[])) == ["tritonserver does not answer /v2/health/live"]
    assert probe.problems(probe.ServerHealth(live=True, models=[])) == ["no model to check"]


def test_a_drain_makes_the_pod_unready_but_not_dead() -> None:
    health = probe.ServerHealth(live=True, models=[_model()], draining=True)
    assert probe.problems(health) == []
    assert "draining" in probe.problems(health, readiness=True)[0]


def test_probe_without_metrics_checks_the_rest() -> None:
    """enable_metrics false (or --allow-metrics=false): no gauge, the other checks still apply."""
    assert probe.problems(probe.ServerHealth(live=True, models=[_model(engine_alive=[])])) == []
    found = probe.problems(probe.ServerHealth(live=True, models=[_model(engine_alive=[], live_stubs=0)]))
    assert "stub" in found[0]


def test_expected_stubs_from_instance_groups() -> None:
    assert probe.expected_stubs({"instance_group": [{"kind": "KIND_CPU", "count": 2}]}) == 2
    assert probe.expected_stubs({"instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}]}) == 2
    assert probe.expected_stubs({"instance_group": [{"kind": "KIND_MODEL", "count": 1, "gpus": []}]}) == 1
    assert probe.expected_stubs({}) == 1


def test_probe_reads_models_and_metrics_from_the_server_command_line() -> None:
    index = [{"name": "a"}, {"name": "b"}]
    explicit = ["tritonserver", "--model-control-mode=explicit", "--load-model=vllm_model", "--load-model", "ensemble"]
    assert probe.model_names(explicit, index) == ["vllm_model", "ensemble"]
    assert probe.model_names(["tritonserver", "--model-control-mode=explicit", "--load-model=*"], index) == ["a", "b"]
    assert probe.model_names(["tritonserver", "--model-repository=/m"], index) == ["a", "b"]
    assert probe.metrics_url(["tritonserver"]) == "http://127.0.0.1:8002/metrics"
    assert probe.metrics_url(["tritonserver", "--metrics-port", "9"]) == "http://127.0.0.1:9/metrics"
    assert probe.metrics_url(["tritonserver", "--allow-metrics=false"]) is None


def test_metric_values_match_the_model_label() -> None:
    text = (
        '# TYPE vllm_multistep:engine_alive gauge\nvllm_multistep:engine_alive{model="m",version="1"} 1\n'
        'vllm_multistep:engine_alive{model="m2",version="1"} 0\n'
    )
    assert probe.metric_values(text, probe.ENGINE_ALIVE_METRIC, "m") == [1.0]
    assert probe.metric_values(text, probe.ENGINE_ALIVE_METRIC, "m2") == [0.0]
    assert probe.metric_values(text, probe.ENGINE_ALIVE_METRIC, "other") == []


def test_probe_command_fails_when_no_server_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["probe", "--drain-file", str(tmp_path / "nobody")]) == 1
    assert "no running tritonserver with" in capsys.readouterr().err
