"""deploy/k8s renders with ``kubectl kustomize`` and says what the code does.

No cluster here: these check the rendered objects' structure and that they
agree with each other and with the metric names tserve exports.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tserve.nursery import LLMStats
from tserve.protocol import EngineStats
from tserve.web._metrics import Metrics

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")

Objects = dict[tuple[str, str], dict[str, Any]]


def render(overlay: str) -> Objects:
    """``kubectl kustomize deploy/k8s/<overlay>``, by (kind, name)."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def env(c: dict[str, Any], name: str) -> str:
    (value,) = [e["value"] for e in c["env"] if e["name"] == name]
    assert isinstance(value, str)
    return value


def metrics_port(deployment: dict[str, Any]) -> int:
    """The port of the pod's metrics process (``--metrics-port``), checked three ways:
    the environment that sets it, the container port named for it, Prometheus's
    annotation."""
    c = container(deployment)
    port = int(env(c, "TSERVE_METRICS_PORT"))
    assert {"name": "metrics", "containerPort": port} in c["ports"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    return port


def test_replicas_behind_a_service_with_liveness_and_readiness() -> None:
    objects = render("replicas")
    deployment = objects["Deployment", "tserve"]
    c = container(deployment)
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    service = objects["Service", "tserve"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    http = {p["containerPort"] for p in c["ports"] if p["name"] == "http"}
    assert http and metrics_port(deployment) not in http


def test_split_engine_and_api_share_one_address_and_the_curve_keys() -> None:
    objects = render("split")
    engine, api = objects["Deployment", "tserve-engine"], objects["Deployment", "tserve-api"]
    e, a = container(engine), container(api)
    assert e["command"] == ["python", "-m", "tserve", "engine"]
    assert flag(e["args"], "--bind").startswith("tcp://")
    port = int(flag(e["args"], "--bind").rsplit(":", 1)[1])
    service = objects["Service", "tserve-engine"]
    assert service["spec"]["ports"][0]["port"] == port
    assert flag(a["args"], "--engine") == f"tcp://tserve-engine:{port}"
    for deployment, c in ((engine, e), (api, a)):
        (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
        assert volume["secret"]["secretName"] == "tserve-curve-keys"
        (mount,) = c["volumeMounts"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        assert flag(c["args"], "--keys") == mount["mountPath"]
    assert api["spec"]["replicas"] != engine["spec"]["replicas"]  # scaled apart
    metrics_port(api)


def _exported_names() -> set[str]:
    stats = LLMStats(live_requests=0, aborts_sent=0, engine=EngineStats(), engine_alive=True)
    text = Metrics(lambda: stats, lambda: 0, "m").render().decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1] != "#"}


def test_the_inference_pool_picks_tserve_pods_by_the_metrics_tserve_exports() -> None:
    objects = render("inference-pool")
    pool = objects["InferencePool", "tserve"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    deployment = objects["Deployment", "tserve"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    http = {p["containerPort"] for p in container(deployment)["ports"] if p["name"] == "http"}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= http  # requests, not metrics
    picker_name = pool["spec"]["endpointPickerRef"]["name"]
    picker = container(objects["Deployment", picker_name])
    service = objects["Service", picker_name]
    picker_port = pool["spec"]["endpointPickerRef"]["port"]["number"]
    assert service["spec"]["ports"][0]["port"] == picker_port
    flags = dict(arg.split("=", 1) for arg in picker["args"])
    assert int(flags["--model-server-metrics-port"]) == metrics_port(deployment)
    metrics = {value for name, value in flags.items() if name.endswith("-metric")}
    assert metrics == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    }
    assert metrics <= _exported_names()
