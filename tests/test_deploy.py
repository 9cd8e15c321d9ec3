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


def stages() -> list[str]:
    """The Dockerfile's stages, each from its ``FROM`` line (comments dropped, continuations joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    out: list[str] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            out.append("")
        out[-1] += line + "\n"
    return out


def test_dockerfile_runs_the_service_as_a_non_root_user_with_a_ready_check(routes):
    d = dockerfile()
    assert d["USER"] == ["mineru"] and "useradd" in " ".join(d["RUN"])
    assert all(image.startswith("python:3.1") for image in d["FROM"])
    assert any("download.pytorch.org/whl/cpu" in run for run in d["RUN"])  # CPU torch
    assert d["VOLUME"] == ['["/models", "/cache"]'] and "MINERU_FAST_MODEL=/models/mineru" in d["ENV"][0]
    assert "MINERU_FAST_PREPARED_CACHE=/cache/prepared" in d["ENV"][0]
    (port,) = d["EXPOSE"]
    (healthcheck,) = d["HEALTHCHECK"]
    ready = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", healthcheck)
    assert ready is not None and ready.groups() == (port, "/ready") and "/ready" in routes
    # ready in seconds (engine check, no canary before ready): a start period of minutes is not needed
    start_period = re.search(r"--start-period=(\d+)s", healthcheck)
    assert start_period is not None and int(start_period.group(1)) <= 120
    command = d["CMD"][0]
    assert f"--port {port}" in command and "--host 0.0.0.0" in command and "mineru-fast serve" in command


def test_the_image_gets_its_kernels_from_a_builder_stage_and_runs_without_a_compiler():
    """The wheel (kernels compiled) is built where the compiler is; the runtime stage installs it
    and has no compiler, so the image runs the own kernels and never builds anything."""
    builder, runtime = stages()
    assert " AS builder" in builder.splitlines()[0] and "g++" in builder and "pip wheel" in builder
    assert "COPY --from=builder /wheels" in runtime and "mineru_fast-*.whl" in runtime
    compiler = re.compile(r"(?<![\w-])(g\+\+|gcc|clang|build-essential)(?![\w-])")
    assert compiler.search(builder) and not compiler.search(runtime)
    copied = " ".join(line for line in builder.splitlines() if line.startswith("COPY"))
    assert all(name in copied for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "mineru_fast"))


def test_kubernetes_prepares_the_model_once_for_the_pods():
    """A Job writes the prepared cache with the pods' model path and cache folder; the pods read it
    read-only; the probes give a start-up in seconds (with the prepared model) room of minutes."""
    m = manifests()
    job = m["Job"]["spec"]["template"]["spec"]
    pod = m["Deployment"]["spec"]["template"]["spec"]
    (prepare,) = job["containers"]
    (serve,) = pod["containers"]
    assert prepare["command"][:2] == ["mineru-fast", "prepare"]
    model = prepare["command"][prepare["command"].index("--model") + 1]
    assert serve["command"][serve["command"].index("--model") + 1] == model
    env = {e["name"]: e["value"] for e in prepare["env"]}
    assert env == {e["name"]: e["value"] for e in serve["env"]} and "MINERU_FAST_PREPARED_CACHE" in env
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in job["volumes"]}
    assert claims == {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    mounts = {v["name"]: v for v in serve["volumeMounts"]}
    assert all(mount.get("readOnly") for mount in mounts.values())
    assert env["MINERU_FAST_PREPARED_CACHE"].startswith(mounts["prepared"]["mountPath"])
    probe = serve["startupProbe"]
    assert 60 <= probe["periodSeconds"] * probe["failureThreshold"] <= 300


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
