"""The deployment files (``deploy/``): the Dockerfile and the Kubernetes manifests agree with each
other and with the service's routes, port and metrics."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def dockerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, in order (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text(encoding="utf-8"))
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, rest = line.strip().partition(" ")
            out.setdefault(instruction.upper(), []).append(rest.strip())
    return out


def manifests() -> dict[str, dict]:
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def routes() -> set[str]:
    pytest.importorskip("fastapi")
    from mineru_fast.serve.app import create_app

    return {route.path for route in create_app().routes}


def test_dockerfile_runs_the_service_as_a_non_root_user_with_a_ready_check(routes):
    d = dockerfile()
    assert d["USER"] == ["mineru"] and "useradd" in " ".join(d["RUN"])
    assert d["FROM"][0].startswith("python:3.1")
    assert any("download.pytorch.org/whl/cpu" in run for run in d["RUN"])  # CPU torch
    assert d["VOLUME"] == ['["/models"]'] and "MINERU_FAST_MODEL=/models/mineru" in d["ENV"][0]
    (port,) = d["EXPOSE"]
    (healthcheck,) = d["HEALTHCHECK"]
    ready = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", healthcheck)
    assert ready is not None and ready.groups() == (port, "/ready") and "/ready" in routes
    command = d["CMD"][0]
    assert f"--port {port}" in command and "--host 0.0.0.0" in command and "mineru-fast serve" in command


def test_kubernetes_deployment_service_and_hpa_agree(routes):
    m = manifests()
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "RayService"} <= set(m)
    deployment, service, hpa = m["Deployment"], m["Service"], m["HorizontalPodAutoscaler"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels == service["spec"]["selector"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    command = container["command"]
    port = int(command[command.index("--port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": port}
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["port"] == "http" and check["path"] in routes
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert any(v["persistentVolumeClaim"] for v in pod["volumes"])
    assert command[command.index("--model") + 1].startswith(container["volumeMounts"][0]["mountPath"])
    assert pod["terminationGracePeriodSeconds"] > float(command[command.index("--drain-timeout") + 1])

    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "mineru_fast_queue_length"


def test_the_queue_metric_the_hpa_scales_on_is_exported():
    pytest.importorskip("prometheus_client")
    from mineru_fast.serve.metrics import ServiceMetrics

    text = ServiceMetrics(queue_length=lambda: 3, in_flight=lambda: 0).exposition().decode()
    assert "mineru_fast_queue_length 3.0" in text


def test_rayservice_names_the_serve_app_builder_and_its_arguments():
    spec = manifests()["RayService"]["spec"]
    (application,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    module, _, name = application["import_path"].partition(":")
    source = (REPO / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    builder = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)
    documented = ast.get_docstring(builder) or ""
    for key in application["args"]:
        assert f"``{key}``" in documented, key
    assert all(isinstance(v, str) for v in application["args"].values())  # serve run passes strings
    workers = spec["rayClusterConfig"]["workerGroupSpecs"][0]
    cpus = workers["rayStartParams"]["num-cpus"]
    assert application["args"]["cores_per_replica"] == cpus  # one replica fills one worker pod
    assert spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
