"""The Helm chart and the plain manifests: they render, every object validates against the
Kubernetes schemas, and what they run is what fleetgate's programs accept.

Rendering uses a real Helm (`make helm` installs one; without it these tests skip, or
fail under FLEETGATE_REQUIRE_HELM=1 as `make test` sets). deploy/k8s is read with
PyYAML and, where kubectl is installed, built with its kustomize. Objects are validated
by kubernetes-validate (Kubernetes' own OpenAPI schemas, offline); the chart's custom
resources (ServiceMonitor, KEDA ScaledObject) by the schemas in tests/data/k8s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.__main__ import DEFAULT_CONFIG
from gateway.settings import load_settings
from tests.conftest import run_module
from workers.__main__ import build_parser as workers_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "fleetgate"
K8S = ROOT / "deploy" / "k8s"
DATA = ROOT / "tests" / "data" / "k8s"
SMI = ROOT / "tests" / "data" / "nvidia-smi"
# The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27", kubernetes_validate.latest_version())
CRDS = ("monitoring.coreos.com/v1/ServiceMonitor", "keda.sh/v1alpha1/ScaledObject")
# The gauges the gateway exports for scaling (issue 18, point 2).
SCALING_METRICS = {"fleetgate_model_outstanding_requests", "fleetgate_model_queue_depth",
                   "fleetgate_model_kv_use_ratio", "fleetgate_model_saturation"}
SECRET_ENV = {"FLEETGATE_ADMIN_TOKEN", "FLEETGATE_API_KEYS", "FLEETGATE_REGISTRATION_SECRET"}
ADMIN_TOKEN = "t0ken-that-must-stay-in-the-secret"
RENDERS: dict[str, list[str]] = {
    "defaults": ["--set", f"secrets.adminToken={ADMIN_TOKEN}", "--set", "secrets.apiKeys=sk-k8s-test-key"],
    "full": ["-f", str(DATA / "values-full.yaml"), *(a for c in CRDS for a in ("--api-versions", c))],
    "full-no-crds": ["-f", str(DATA / "values-full.yaml")],
}


def helm_binary() -> str | None:
    for candidate in (os.environ.get("FLEETGATE_HELM"), str(ROOT / ".cache" / "helm" / "bin" / "helm"),
                      shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def helm() -> str:
    found = helm_binary()
    if found is None:
        message = "no helm binary (run `make helm`, or set FLEETGATE_HELM)"
        if os.environ.get("FLEETGATE_REQUIRE_HELM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def helm_template(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, "template", "t", str(CHART), *args], capture_output=True, text=True,
                          timeout=60)


@cache
def rendered(helm: str, name: str) -> tuple[dict[str, Any], ...]:
    proc = helm_template(helm, *RENDERS[name])
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


@cache
def plain(name: str) -> tuple[dict[str, Any], ...]:
    """deploy/k8s: the base's files as kustomization.yaml lists them, or a kustomize build."""
    if name == "base-files":
        base = K8S / "base"
        files = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
        return tuple(d for f in files for d in yaml.safe_load_all((base / f).read_text()) if d)
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl for `kubectl kustomize`")
    out = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


@cache
def crd_schemas() -> dict[str, Any]:
    return yaml.safe_load((DATA / "crd_schemas.yaml").read_text())  # type: ignore[no-any-return]


def schema_errors(doc: dict[str, Any], version: str) -> list[str]:
    """What the Kubernetes schema of `version` (or the CRD schema) rejects in `doc`."""
    key = f"{doc.get('apiVersion')}/{doc.get('kind')}"
    if key in crd_schemas():
        validator = jsonschema.Draft202012Validator(crd_schemas()[key])
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def set_pairs(args: list[str]) -> dict[str, Any]:
    """The gateway's `--set KEY=VALUE` pairs, as it reads them (YAML values)."""
    pairs = (args[i + 1].partition("=") for i, a in enumerate(args) if a == "--set")
    return {k: yaml.safe_load(v) for k, _, v in pairs}


def all_sets(helm: str | None) -> dict[str, tuple[dict[str, Any], ...]]:
    sets = {name: rendered(helm, name) for name in RENDERS} if helm else {}
    sets["plain"] = plain("base-files")
    return sets


# -- schemas -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_chart_renders_and_every_object_validates(helm: str, name: str) -> None:
    """`helm template` renders the chart, and each object passes Kubernetes' strict schemas (1.27 and newest)."""
    docs = rendered(helm, name)
    assert {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    errors = {f"{d['kind']}/{d['metadata']['name']} @{v}": e
              for d in docs for v in KUBE_VERSIONS if (e := schema_errors(d, v))}
    assert errors == {}


@pytest.mark.parametrize("name", ["base-files", "base", "overlays/sim"])
def test_plain_manifests_and_kustomize_builds_validate(name: str) -> None:
    """deploy/k8s as files and as kustomize builds it (base, the simulator overlay): every object validates."""
    docs = plain(name)
    assert {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget"} <= {d["kind"] for d in docs}
    assert of_kind(docs, "Secret") == []  # the operator creates it (deploy/k8s/values.yaml says how)
    errors = {f"{d['kind']}/{d['metadata']['name']} @{v}": e
              for d in docs for v in KUBE_VERSIONS if (e := schema_errors(d, v))}
    assert errors == {}


def test_the_validation_rejects_broken_objects() -> None:
    """The checks can fail: a misspelt container field, a bad probe and a bad KEDA trigger are rejected."""
    good = plain("base-files")
    sts = yaml.safe_load(yaml.safe_dump(of_kind(good, "StatefulSet")[0]))
    assert schema_errors(sts, KUBE_VERSIONS[0]) == []
    container(sts)["imagePullPolicyy"] = "Always"
    assert schema_errors(sts, KUBE_VERSIONS[0])
    sts = yaml.safe_load(yaml.safe_dump(of_kind(good, "StatefulSet")[0]))
    container(sts)["readinessProbe"]["exec"]["command"] = "python -m workers.health"  # not a list
    assert schema_errors(sts, KUBE_VERSIONS[-1])
    scaled = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
              "spec": {"scaleTargetRef": {"name": "w"}, "triggers": [{"type": "prometheus",
                                                                     "metadata": {"threshold": 0.8}}]}}
    assert schema_errors(scaled, KUBE_VERSIONS[-1])


def test_plain_manifests_are_the_chart_rendered(helm: str, tmp_path: Path) -> None:
    """deploy/k8s/base is what scripts/render_k8s.sh writes from the chart today (they cannot drift apart)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "render_k8s.sh"), str(tmp_path)], check=True, timeout=60,
                   env={**os.environ, "HELM": helm})
    for path in sorted(tmp_path.glob("*.yaml")):
        assert (K8S / "base" / path.name).read_text() == path.read_text(), f"re-run scripts/render_k8s.sh: {path.name}"


def test_custom_resources_render_only_where_their_api_is_served(helm: str) -> None:
    """ServiceMonitor and ScaledObject need their CRDs (helm's --api-versions stands for a cluster that has them)."""
    kinds = {d["kind"] for d in rendered(helm, "full")}
    assert {"ServiceMonitor", "ScaledObject", "HorizontalPodAutoscaler"} <= kinds
    kinds = {d["kind"] for d in rendered(helm, "full-no-crds")}
    assert "ServiceMonitor" not in kinds and "ScaledObject" not in kinds
    assert "HorizontalPodAutoscaler" in kinds  # autoscaling/v2 is always served
    assert {d["kind"] for d in rendered(helm, "defaults")}.isdisjoint({"ServiceMonitor", "ScaledObject",
                                                                       "HorizontalPodAutoscaler"})


@pytest.mark.parametrize("name", ["defaults", "full-no-crds"])  # lint takes no --api-versions
def test_helm_lint_passes(helm: str, name: str) -> None:
    """`helm lint --strict` finds nothing to fix in the chart with either set of values."""
    proc = subprocess.run([helm, "lint", "--strict", str(CHART), *RENDERS[name]], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_chart_refuses_to_render_without_an_admin_token(helm: str) -> None:
    """No admin token and no existing Secret: helm fails and says which value to set."""
    proc = helm_template(helm)
    assert proc.returncode != 0 and "secrets.adminToken" in proc.stderr


# -- what the manifests say ---------------------------------------------------------------


def test_workers_request_their_gpus_on_their_node_pool(helm: str) -> None:
    """Each pool's pods request (and limit) `gpus` nvidia.com/gpu, name the cards 0..gpus-1, sit on its nodes."""
    values = yaml.safe_load((DATA / "values-full.yaml").read_text())
    pools = {p["name"]: p for p in values["workers"]["pools"]}
    sets = of_kind(rendered(helm, "full"), "StatefulSet")
    assert len(sets) == len(pools)
    for sts in sets:
        pool = pools[sts["metadata"]["labels"]["fleetgate.io/pool"]]
        c, spec = container(sts), sts["spec"]["template"]["spec"]
        assert spec.get("nodeSelector", {}) == pool.get("nodeSelector", {})
        if pool["gpus"]:
            assert c["resources"]["requests"]["nvidia.com/gpu"] == pool["gpus"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == pool["gpus"]
            assert after(c["args"], "--gpu") == ",".join(str(i) for i in range(pool["gpus"]))
        else:
            assert "nvidia.com/gpu" not in str(c.get("resources")) and "--gpu" not in c["args"]
    defaults = of_kind(rendered(helm, "defaults"), "StatefulSet")[0]
    assert container(defaults)["resources"]["requests"]["nvidia.com/gpu"] == 1


def test_agents_advertise_the_pod_ip_and_their_pod_name(helm: str) -> None:
    """--advertise-host is $(POD_IP) from status.podIP; --id is the StatefulSet pod's name."""
    for name, docs in all_sets(helm).items():
        for sts in of_kind(docs, "StatefulSet"):
            c = container(sts)
            env = {e["name"]: e for e in c["env"]}
            assert after(c["args"], "--advertise-host") == "$(POD_IP)", name
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert after(c["args"], "--id") == "$(FLEETGATE_WORKER_ID)"
            assert env["FLEETGATE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert after(c["args"], "--host") == "0.0.0.0"


def test_secrets_are_referenced_never_inlined(helm: str) -> None:
    """Tokens, keys and the registration secret reach containers only through secretKeyRef."""
    for name, docs in all_sets(helm).items():
        for doc in of_kind(docs, "Deployment") + of_kind(docs, "StatefulSet"):
            c = container(doc)
            for e in c.get("env", []):
                if e["name"] in SECRET_ENV:
                    assert "value" not in e and e["valueFrom"]["secretKeyRef"]["name"], (name, e)
            assert not any(a.startswith("--admin-token") for a in c.get("args", []))
    docs = rendered(helm, "defaults")
    (secret,) = of_kind(docs, "Secret")
    others = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert ADMIN_TOKEN in secret["stringData"].values() and ADMIN_TOKEN not in others
    assert "sk-k8s-test-key" not in others
    assert of_kind(rendered(helm, "full"), "Secret") == []  # existingSecret: the chart makes none
    full = rendered(helm, "full")
    assert {e["valueFrom"]["secretKeyRef"]["name"] for d in of_kind(full, "Deployment")
            for e in container(d)["env"] if e["name"] in SECRET_ENV} == {"fleetgate-prod"}


def test_probes_point_at_real_paths_and_ports(helm: str) -> None:
    """Gateway probes GET /health on the port it listens on; agents' readiness runs workers.health,
    liveness GETs the engine's health path on the engine's --port."""
    from workers.engines import get_engine

    for name, docs in all_sets(helm).items():
        for gw in of_kind(docs, "Deployment"):
            if gw["metadata"]["name"].endswith("-redis"):
                continue
            c = container(gw)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert int(after(c["args"], "--port")) == ports["http"]
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, name
        for sts in of_kind(docs, "StatefulSet"):
            c = container(sts)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert int(after(c["args"], "--port")) == ports["engine"]
            engine = after(c["args"], "--engine")
            paths = {get_engine(e).health_path for e in ("vllm", "lmdeploy")} if engine == "auto" else {
                get_engine(engine).health_path}
            assert paths == {c["livenessProbe"]["httpGet"]["path"]} and c["livenessProbe"]["httpGet"]["port"] == "engine"
            for probe in ("startupProbe", "readinessProbe"):
                assert c[probe]["exec"]["command"] == ["python", "-m", "workers.health"]


def test_termination_grace_covers_the_agents_drain(helm: str) -> None:
    """The pod's grace period outlasts --drain-grace plus the engine's 15 s stop; preStop signals the agent (PID 1) and waits."""
    for name, docs in all_sets(helm).items():
        for sts in of_kind(docs, "StatefulSet"):
            c = container(sts)
            grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= float(after(c["args"], "--drain-grace")) + 15 + 5, name
            assert c["command"] == ["python", "-m", "workers"]  # the agent is PID 1
            hook = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
            assert "kill -TERM 1" in hook and "while kill -0 1" in hook


def test_worker_args_parse_and_dry_run_on_their_cards(helm: str) -> None:
    """Each pool's args pass the agent's own parser and its --dry-run plans an engine for that card."""
    cards = {"h100": "h100-80gb-hbm3.txt", "t4": "t4.txt", "h100x2": "8x-h100-80gb-hbm3.txt", "sim": "none.txt"}
    env = {"POD_IP": "10.1.2.3", "FLEETGATE_WORKER_ID": "t-fleetgate-workers-x-0"}
    planned = {}
    for sts in of_kind(rendered(helm, "full"), "StatefulSet") + of_kind(plain("base-files"), "StatefulSet"):
        c = container(sts)
        args = expand(c["args"], env)
        workers_parser().parse_args(args)  # SystemExit on a flag it does not know
        pool = sts["metadata"]["labels"]["fleetgate.io/pool"]
        proc = run_module("workers", *args, "--dry-run", "--nvidia-smi-output", str(SMI / cards.get(pool, "h100-80gb-hbm3.txt")))
        assert proc.returncode == 0, (pool, proc.stderr)
        assert "# worker id: t-fleetgate-workers-x-0" in proc.stdout
        planned[pool] = proc.stdout
    assert "lmdeploy serve api_server" in planned["t4"] and "--backend pytorch" in planned["t4"]
    assert "--enable-lora" in planned["h100"] and "--tensor-parallel-size 2" in planned["h100x2"]


def test_gateway_args_are_real_flags_and_settings(helm: str) -> None:
    """The gateway's args are flags of `python -m gateway`, and its --set pairs (with its env: the
    tracing endpoint of the full values) load as real settings."""
    proc = run_module("gateway", "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    known = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out))
    for name, docs in all_sets(helm).items():
        for gw in of_kind(docs, "Deployment"):
            c = container(gw)
            if c["name"] != "gateway":
                continue
            assert c["command"] == ["python", "-m", "gateway"]
            assert {a for a in c["args"] if a.startswith("--")} <= known, name
            settings = load_settings(DEFAULT_CONFIG, set_pairs(c["args"]), environ={})
            assert settings.policy == after(c["args"], "--policy")
    full = next(container(d) for d in of_kind(rendered(helm, "full"), "Deployment") if container(d)["name"] == "gateway")
    env = {e["name"]: e["value"] for e in full["env"] if "value" in e}
    settings = load_settings(DEFAULT_CONFIG, set_pairs(full["args"]), environ=env)
    assert settings.rate_limit_rpm == 600 and settings.routing["balance"] == 0.3
    assert settings.tracing_endpoint == "http://otel-collector.observability:4318/v1/traces"
    assert settings.tracing_service == "fleetgate-edge"


def test_autoscalers_scale_the_pool_on_the_gateways_gauges(helm: str) -> None:
    """KEDA's query and the HPA's external metric name the gateway's per-model gauges and target a rendered StatefulSet."""
    docs = rendered(helm, "full")
    sets = {d["metadata"]["name"] for d in of_kind(docs, "StatefulSet")}
    (scaled,) = of_kind(docs, "ScaledObject")
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    for obj in (scaled, hpa):
        assert obj["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        assert obj["spec"]["scaleTargetRef"]["name"] in sets
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert set(re.findall(r"fleetgate_model_\w+", query)) <= SCALING_METRICS and 'model="qwen2.5-7b-instruct"' in query
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]
    assert metric["name"] in SCALING_METRICS and metric["selector"]["matchLabels"] == {"model": "qwen2.5-7b-instruct"}
    autoscaled = {o["spec"]["scaleTargetRef"]["name"] for o in (scaled, hpa)}
    for sts in of_kind(docs, "StatefulSet"):  # the autoscaler owns replicas: the chart leaves them out
        assert ("replicas" in sts["spec"]) == (sts["metadata"]["name"] not in autoscaled)
