"""KubeRay manifests, validated offline: render every overlay with the pinned kustomize, validate against the
KubeRay CRD schemas, and check the invariants of STYLE.md item 20 (pure CPU, no cluster, no marker).

Each invariant is a function `*_problems(...) -> list[str]` (empty: holds). Every one is tested twice: it holds
on every rendered overlay, and it reports a deliberately broken copy of a rendered manifest.

Needs: Go on PATH (scripts/setup/install_kustomize.sh builds kustomize once into .cache/bin). The CRD schemas are
in the repository (`k8s/crds/kuberay/`, with their source). Either missing: the tests FAIL, never skip.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tomllib
import warnings
from collections.abc import Iterator, Mapping
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from characters.config import TOPOLOGIES
from placement import NodeCapacity, PlacementSpec, bundles_for, free_bundles

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO / "k8s" / "crds" / "kuberay"
K8S = REPO / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
GPUS_PER_NODE = 8  # every supported node type: HGX/DGX H100 and B200 boards, one NVLink domain of 8 GPUs

# overlay -> (topology, accelerator, sessions per 8-GPU node, GPUs idle per node): the sizing table in
# docs/kubernetes.md. The computed values must equal these (test_sizing_table).
SIZING = {
    "h100-h100x5": ("h100x5", "H100", 1, 3),
    "h100-h100x4": ("h100x4", "H100", 2, 0),
    "b200-b200x3": ("b200x3", "B200", 2, 2),
}
GPU_KEYS = ("nvidia.com/gpu", "amd.com/gpu", "gpu")
SECRET_ENV = ("LIVEKIT_URL", "LIVEKIT_API_KEY", "LIVEKIT_API_SECRET", "CHARACTERS_API_KEYS", "CHARACTERS_DATABASE_URL")
SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.IGNORECASE)
PRESTOP_MARGIN_S = 30  # grace period left for `ray stop` after the preStop wait
INGRESS = "CharactersIngress"  # deployments.api.app's ingress deployment
SERVICE_KEYS = ("preset", "topology", "warm_slots", "queue_max", "queue_timeout_s")
API_KEYS = ("max_duration_s",)


# ---------------------------------------------------------------------------------------------- rendering


def pinned_ray() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d.split("==", 1)[1].strip() for d in deps if re.match(r"ray(\[[^\]]*\])?==", d)]
    assert len(pins) == 1, f"pyproject.toml must pin ray exactly once as ray[...]==X.Y.Z; found {pins}"
    return pins[0]


@pytest.fixture(scope="session")
def kustomize() -> Path:
    script = REPO / "scripts" / "setup" / "install_kustomize.sh"
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{script} failed (exit {proc.returncode}); it needs Go >= 1.26 and the Go module proxy:\n"
                    f"{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def build(kustomize: Path, path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([str(kustomize), "build", str(path)], capture_output=True, text=True, timeout=120,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"kustomize build {path.relative_to(REPO)} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="session")
def rendered(kustomize: Path) -> dict[str, list[dict[str, Any]]]:
    """Every overlay, plus the base, rendered once."""
    out = {name: build(kustomize, K8S / "overlays" / name) for name in OVERLAYS}
    out["base"] = build(kustomize, K8S / "base")
    return out


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


# ------------------------------------------------------------------------------------------- CRD schemas


@cache
def crd_schema(plural: str) -> dict[str, Any]:
    path = SCHEMA_DIR / f"ray.io_{plural}.yaml"
    if not path.is_file():
        pytest.fail(f"KubeRay CRD schema {path} is missing from the checkout (k8s/crds/kuberay/README.md says "
                    "where it comes from)")
    crd = yaml.safe_load(path.read_text())
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    return strict(versions["v1"]["schema"]["openAPIV3Schema"])


def strict(node: Any) -> Any:
    """A Kubernetes structural schema made to behave like the API server with strict field validation.

    - object with `properties` and no `additionalProperties`: unknown fields are errors (the server prunes
      or, with `kubectl apply --validate=strict`, rejects them), unless `x-kubernetes-preserve-unknown-fields`;
    - `x-kubernetes-int-or-string`: an integer or a string;
    - `x-kubernetes-list-type: map|set` are enforced by the keywords in `_k8s_list_keys` / `uniqueItems`;
    - `x-kubernetes-validations` (CEL) are not evaluated: the fields they guard (managedBy, GCS FT backend)
      are not set by these manifests.
    """
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    preserve = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def _k8s_list_keys(validator: Any, keys: list[str], instance: Any, schema: Mapping[str, Any]) -> Iterator[Any]:
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen: set[tuple[Any, ...]] = set()
    for item in instance:
        key = tuple(json.dumps(item.get(k), sort_keys=True) for k in keys)
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry with {dict(zip(keys, key, strict=True))} in a list "
                                             f"keyed by {keys}")
        seen.add(key)


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


K8sValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _k8s_list_keys})


def schema_problems(doc: Mapping[str, Any]) -> list[str]:
    """A RayService (and its rayClusterConfig as a RayCluster) against the KubeRay v1 CRD schemas."""
    objects = [("rayservices", doc)]
    if doc.get("kind") == "RayService":
        spec = doc.get("spec", {}).get("rayClusterConfig", {})
        objects.append(("rayclusters", {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                                        "metadata": {"name": doc["metadata"]["name"]}, "spec": spec}))
    elif doc.get("kind") == "RayCluster":
        objects = [("rayclusters", doc)]
    problems = []
    for plural, obj in objects:
        validator = K8sValidator(crd_schema(plural), format_checker=FORMATS)
        for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in err.absolute_path)
            problems.append(f"{plural[:-1]} {where or '<root>'}: {err.message}")
    return problems


# -------------------------------------------------------------------------------------------- accessors


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity ("96", "500m", "1000Gi", "1e3") as a number."""
    s = str(value)
    binary = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    decimal = {suffix: Decimal(f"1e{exp}") for suffix, exp in
               (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9), ("T", 12), ("P", 15), ("E", 18))}
    for suffix, mult in binary.items():
        if s.endswith(suffix):
            return Decimal(s[: -len(suffix)]) * mult
    if s and s[-1] in decimal:
        return Decimal(s[:-1]) * decimal[s[-1]]
    return Decimal(s)


def cluster(rs: Mapping[str, Any]) -> dict[str, Any]:
    return rs["spec"]["rayClusterConfig"]


def groups(rs: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, group spec) of the head group and every worker group."""
    spec = cluster(rs)
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def pod_specs(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template in a rendered object."""
    if doc.get("kind") == "RayService":
        return [(name, g["template"]["spec"]) for name, g in groups(doc)]
    template = doc.get("spec", {}).get("template", {})
    return [(doc["metadata"]["name"], template["spec"])] if "spec" in template else []


def containers(doc: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{where}/{c['name']}", c) for where, spec in pod_specs(doc)
            for c in spec.get("initContainers", []) + spec.get("containers", [])]


def serve_config(rs: Mapping[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def application(rs: Mapping[str, Any]) -> dict[str, Any]:
    apps = serve_config(rs)["applications"]
    assert len(apps) == 1, f"expected one Serve application, found {[a.get('name') for a in apps]}"
    return apps[0]


def app_args(rs: Mapping[str, Any]) -> dict[str, Any]:
    """The args deployments.api.app:build_app gets: {service: {...}, api: {...}, ingress: {...}}."""
    return application(rs).get("args") or {}


def service_args(rs: Mapping[str, Any]) -> dict[str, Any]:
    return app_args(rs).get("service") or {}


def ingress_user_config(rs: Mapping[str, Any]) -> dict[str, Any]:
    """The ingress deployment's user_config (Serve applies it in place with reconfigure(): the drain switch)."""
    for d in application(rs).get("deployments") or []:
        if d.get("name") == INGRESS:
            return d.get("user_config") or {}
    return {}


def ray_node_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources of one pod of a group, as KubeRay passes them to `ray start`."""
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    params = group.get("rayStartParams", {})
    out: dict[str, float] = {}
    if "cpu" in limits:
        out["CPU"] = float(quantity(limits["cpu"]))
    gpus = sum(float(quantity(limits[k])) for k in GPU_KEYS if k in limits)
    if gpus:
        out["GPU"] = gpus
    if "num-cpus" in params:
        out["CPU"] = float(params["num-cpus"])
    if "num-gpus" in params:
        out["GPU"] = float(params["num-gpus"])
    custom = dict(group.get("resources", {}))
    if not custom and "resources" in params:
        custom = json.loads(params["resources"].strip("'\" "))
    out.update({key: float(quantity(value)) for key, value in custom.items()})
    return out


def topology_spec(rs: Mapping[str, Any]) -> PlacementSpec:
    name = service_args(rs).get("topology")
    assert name in TOPOLOGIES, f"serveConfigV2 topology={name!r} is not one of {sorted(TOPOLOGIES)}"
    return bundles_for(TOPOLOGIES[name])


def sessions_per_node(rs: Mapping[str, Any], group: Mapping[str, Any]) -> int:
    """Whole sessions of the RayService's topology one empty pod of ``group`` holds (the real policy's count)."""
    total = ray_node_resources(group)
    return free_bundles([NodeCapacity("node", free=total, total=total)], topology_spec(rs))


def preStop_wait_s(container: Mapping[str, Any]) -> float | None:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    match = re.search(r"--max-wait-s[ =](\d+)", " ".join(command))
    return float(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------- invariants


def head_gpu_problems(rs: Mapping[str, Any]) -> list[str]:
    """The head never offers or requests a GPU: `num-gpus: "0"` and no GPU in any of its containers."""
    head = cluster(rs)["headGroupSpec"]
    problems = []
    if head.get("rayStartParams", {}).get("num-gpus") != "0":
        problems.append(f"head rayStartParams num-gpus={head.get('rayStartParams', {}).get('num-gpus')!r}, "
                        "must be \"0\"")
    for c in head["template"]["spec"]["containers"]:
        for kind in ("requests", "limits"):
            gpus = {k: v for k, v in c.get("resources", {}).get(kind, {}).items() if k in GPU_KEYS}
            if gpus:
                problems.append(f"head container {c['name']} {kind} GPUs {gpus}; the head must have none")
    if any(k.upper() == "GPU" or k in GPU_KEYS for k in head.get("resources", {})):
        problems.append(f"head group resources {head['resources']} name a GPU")
    return problems


def requests_limits_problems(doc: Mapping[str, Any]) -> list[str]:
    """Every container with a GPU has cpu, memory and GPU set with requests == limits (Guaranteed QoS)."""
    problems = []
    for where, c in containers(doc):
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        if not any(k in GPU_KEYS for k in {**req, **lim}):
            continue
        for key in ("cpu", "memory", *[k for k in GPU_KEYS if k in {**req, **lim}]):
            if key not in req or key not in lim:
                problems.append(f"{where}: {key} must be in both requests and limits (requests={req}, limits={lim})")
            elif quantity(req[key]) != quantity(lim[key]):
                problems.append(f"{where}: {key} requests {req[key]} != limits {lim[key]}")
        extra = set(req) ^ set(lim)
        if extra:
            problems.append(f"{where}: resources {sorted(extra)} are in only one of requests/limits")
    return problems


def bundle_fit_problems(rs: Mapping[str, Any]) -> list[str]:
    """Every GPU worker pod holds at least one whole session bundle (placement.bundles_for) of the topology."""
    spec = topology_spec(rs)
    problems = []
    gpu_groups = [(n, g) for n, g in groups(rs)[1:] if ray_node_resources(g).get("GPU")]
    if not gpu_groups:
        problems.append("no worker group has GPUs")
    for name, group in gpu_groups:
        node = ray_node_resources(group)
        if sessions_per_node(rs, group) < 1:
            problems.append(f"worker group {name} offers {node}, which does not hold one {spec.topology} session "
                            f"(needs {spec.demand()} on one node, STRICT_PACK)")
    return problems


def ray_version_problems(rs: Mapping[str, Any], pinned: str) -> list[str]:
    got = cluster(rs).get("rayVersion")
    return [] if got == pinned else [f"rayVersion={got!r} differs from the ray[serve]=={pinned} pin in pyproject.toml"]


def image_problems(doc: Mapping[str, Any]) -> list[str]:
    """Every image is pinned: a digest or an explicit tag that is not `latest`."""
    images = [(where, c.get("image", "")) for where, c in containers(doc)]
    if doc.get("kind") == "RayService" and "image" in cluster(doc).get("autoscalerOptions", {}):
        images.append(("autoscaler", cluster(doc)["autoscalerOptions"]["image"]))
    problems = []
    for where, image in images:
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        if not name or "/" in tag or not tag:
            problems.append(f"{where}: image {image!r} has no tag or digest; pin one")
        elif tag == "latest":
            problems.append(f"{where}: image {image!r} uses :latest; pin a version or a digest")
    return problems


def secret_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Secrets reach containers only through `secretKeyRef`; none is in the manifests themselves."""
    problems = [f"Secret {d['metadata']['name']} is in the manifests; create it out of band (docs/kubernetes.md)"
                for d in docs if d.get("kind") == "Secret"]
    for doc in docs:
        for where, c in containers(doc):
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    problems.append(f"{where}: envFrom.secretRef {src['secretRef'].get('name')}; use secretKeyRef")
            env = {e["name"]: e for e in c.get("env", [])}
            for name, e in env.items():
                if SECRET_NAME.search(name) and "secretKeyRef" not in e.get("valueFrom", {}):
                    problems.append(f"{where}: {name} is not from a secretKeyRef")
            if doc.get("kind") == "RayService":
                for name in SECRET_ENV:
                    if "secretKeyRef" not in env.get(name, {}).get("valueFrom", {}):
                        problems.append(f"{where}: {name} must come from a secretKeyRef")
    return problems


def autoscaler_problems(rs: Mapping[str, Any]) -> list[str]:
    spec = cluster(rs)
    problems = []
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(f"enableInTreeAutoscaling={spec.get('enableInTreeAutoscaling')!r}, must be true")
    if not spec.get("autoscalerOptions"):
        problems.append("autoscalerOptions missing")
    for g in spec.get("workerGroupSpecs", []):
        lo, n, hi = g.get("minReplicas"), g.get("replicas", g.get("minReplicas")), g.get("maxReplicas")
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= n <= hi and lo < hi):
            problems.append(f"worker group {g['groupName']}: need minReplicas <= replicas <= maxReplicas and "
                            f"min < max to scale; got {lo}, {n}, {hi}")
    return problems


def warm_slot_problems(rs: Mapping[str, Any]) -> list[str]:
    """Warm slots hold bundles for good: more than the minimum nodes hold would pin nodes above the minimum."""
    warm = service_args(rs).get("warm_slots", 0)
    held = sum(g["minReplicas"] * sessions_per_node(rs, g) for _, g in groups(rs)[1:])
    return [] if warm <= held else [f"warm_slots={warm} exceeds the {held} sessions the minReplicas nodes hold"]


def upgrade_problems(rs: Mapping[str, Any]) -> list[str]:
    """Upgrades never cut a session: NewCluster, old cluster kept and pods' grace >= the longest session."""
    max_s = (app_args(rs).get("api") or {}).get("max_duration_s")
    queue_s = service_args(rs).get("queue_timeout_s")
    if not isinstance(max_s, int | float) or not isinstance(queue_s, int | float):
        return [f"serveConfigV2 needs numeric args.api.max_duration_s and args.service.queue_timeout_s; got "
                f"{max_s!r}, {queue_s!r}"]
    longest = max_s + queue_s  # admitted at the last moment of its queue wait, then runs its longest
    problems = []
    draining = ingress_user_config(rs).get("draining")
    if draining is not False:
        problems.append(f"{INGRESS} user_config.draining={draining!r}; a deployed service starts with false")
    if rs["spec"].get("upgradeStrategy", {}).get("type") != "NewCluster":
        problems.append(f"upgradeStrategy={rs['spec'].get('upgradeStrategy')}; NewCluster keeps old sessions alive")
    delay = rs["spec"].get("rayClusterDeletionDelaySeconds", 60)
    if delay < longest:
        problems.append(f"rayClusterDeletionDelaySeconds={delay} < max_duration_s + queue_timeout_s = {longest}")
    for name, g in groups(rs):
        grace = g["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        ray = g["template"]["spec"]["containers"][0]
        wait = preStop_wait_s(ray)
        if grace < longest + PRESTOP_MARGIN_S:
            problems.append(f"{name}: terminationGracePeriodSeconds={grace} < {longest} + {PRESTOP_MARGIN_S}")
        if wait is None:
            problems.append(f"{name}: container {ray['name']} has no preStop hook waiting for sessions")
        elif not longest <= wait <= grace - PRESTOP_MARGIN_S:
            problems.append(f"{name}: preStop --max-wait-s={wait:.0f} must be within [{longest}, "
                            f"{grace - PRESTOP_MARGIN_S}] (longest session .. grace - margin)")
    return problems


def serve_config_problems(rs: Mapping[str, Any]) -> list[str]:
    """serveConfigV2 parses with the pinned Ray's own schema and names the project's application builder."""
    with warnings.catch_warnings():  # Ray 2.60's pydantic models warn on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from ray.serve.schema import ServeDeploySchema

    try:
        config = ServeDeploySchema.model_validate(serve_config(rs))
    except Exception as e:  # noqa: BLE001 - pydantic's error (v1 or v2) is the message we report
        return [f"serveConfigV2 is not a valid Serve config: {e}"]
    problems = []
    for app in config.applications:
        if app.import_path != "deployments.api.app:build_app":
            problems.append(f"application {app.name} import_path={app.import_path!r}, "
                            "want deployments.api.app:build_app")
    service, api = service_args(rs), app_args(rs).get("api") or {}
    missing = [f"service.{k}" for k in SERVICE_KEYS if k not in service] + [f"api.{k}" for k in API_KEYS
                                                                               if k not in api]
    if missing:
        problems.append(f"serveConfigV2 args lack {missing}: the manifest must state them, not inherit defaults")
    if "draining" not in ingress_user_config(rs):
        problems.append(f"serveConfigV2 has no {INGRESS} user_config.draining (the drain switch)")
    return problems


def builder_problems(rs: Mapping[str, Any]) -> list[str]:
    """The application's args are accepted by the real builder's parser, and gRPC names its servicer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from deployments.api.app import parse_args
        from deployments.api.grpc_service import GRPC_SERVICER_FUNCTIONS

    problems = []
    try:
        parse_args(app_args(rs))
    except ValueError as e:
        problems.append(f"deployments.api.app.parse_args refuses the serveConfigV2 args: {e}")
    servicers = (serve_config(rs).get("grpc_options") or {}).get("grpc_servicer_functions")
    if tuple(servicers or ()) != GRPC_SERVICER_FUNCTIONS:
        problems.append(f"grpc_options.grpc_servicer_functions={servicers}, want {list(GRPC_SERVICER_FUNCTIONS)}")
    return problems


def reference_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Every ConfigMap a pod mounts or reads exists in the rendering (kustomize renamed it consistently)."""
    names = {d["metadata"]["name"] for d in docs if d.get("kind") == "ConfigMap"}
    problems = []
    for doc in docs:
        for where, spec in pod_specs(doc):
            refs = [v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v]
            refs += [s["configMapRef"]["name"] for c in spec.get("containers", []) for s in c.get("envFrom", [])
                     if "configMapRef" in s]
            problems += [f"{where}: ConfigMap {r} is not in the manifests" for r in refs if r not in names]
    return problems


def telemetry_problems(docs: list[dict[str, Any]]) -> list[str]:
    """OTEL_* points at the collector's OTLP gRPC port; the collector receives OTLP gRPC + HTTP, batches, exports;
    Ray's metrics port is annotated for Prometheus."""
    problems = []
    env: dict[str, str] = next((d["data"] for d in docs if d.get("kind") == "ConfigMap"
                and d["metadata"]["name"].startswith("characters-env")), {})
    services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    match = re.fullmatch(r"http://([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", endpoint)
    if not match:
        problems.append(f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r} is not http://<service>:<port>")
    else:
        svc = services.get(match.group(1))
        if svc is None or int(match.group(2)) not in [p["port"] for p in svc["spec"]["ports"]]:
            problems.append(f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r} names no Service port in the manifests")
    configs = [yaml.safe_load(v) for d in docs if d.get("kind") == "ConfigMap"
               and d["metadata"]["name"].startswith("otel-collector-config") for v in d["data"].values()]
    if len(configs) != 1:
        problems.append(f"expected one OpenTelemetry Collector config, found {len(configs)}")
    else:
        cfg = configs[0]
        protocols = cfg.get("receivers", {}).get("otlp", {}).get("protocols", {})
        if not {"grpc", "http"} <= set(protocols):
            problems.append(f"collector otlp receiver protocols {sorted(protocols)}; need grpc and http")
        for name, pipe in cfg.get("service", {}).get("pipelines", {}).items():
            if "batch" not in pipe.get("processors", []):
                problems.append(f"collector pipeline {name} has no batch processor")
            for kind in ("receivers", "processors", "exporters"):
                missing = [x for x in pipe.get(kind, []) if x not in cfg.get(kind, {})]
                if missing or (not pipe.get(kind) and kind != "processors"):
                    problems.append(f"collector pipeline {name} {kind} {pipe.get(kind)}: undefined {missing}")
    for doc in docs:
        if doc.get("kind") != "RayService":
            continue
        for name, g in groups(doc):
            port = g.get("rayStartParams", {}).get("metrics-export-port")
            notes = g["template"].get("metadata", {}).get("annotations", {})
            if notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != port:
                problems.append(f"{name}: Prometheus annotations {notes} do not scrape metrics-export-port={port}")
    return problems


def probe_problems(rs: Mapping[str, Any]) -> list[str]:
    """Every GPU worker's container is probed through its node's Serve proxy: readiness on /readyz (the scheduler
    answers and the warm slots are warm), liveness on /healthz, both on the port Serve's HTTP listens on."""
    port = serve_config(rs).get("http_options", {}).get("port", 8000)
    problems = []
    for name, g in groups(rs):
        if name == "head":
            continue
        for c in g["template"]["spec"]["containers"]:
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                got = c.get(probe, {}).get("httpGet", {})
                if (got.get("path"), got.get("port")) != (path, port):
                    problems.append(f"{name}/{c['name']}: {probe} is {got or None}; need httpGet {path} on {port}")
    return problems


def rayservice_problems(rs: Mapping[str, Any], pinned: str) -> list[str]:
    return (schema_problems(rs) + head_gpu_problems(rs) + requests_limits_problems(rs) + bundle_fit_problems(rs)
            + ray_version_problems(rs, pinned) + image_problems(rs) + autoscaler_problems(rs)
            + warm_slot_problems(rs) + upgrade_problems(rs) + serve_config_problems(rs) + builder_problems(rs)
            + probe_problems(rs))


# ------------------------------------------------------------------------------------- the rendered manifests


def test_crd_schemas_are_present() -> None:
    for plural in ("rayservices", "rayclusters"):
        assert crd_schema(plural)["properties"]["kind"]["type"] == "string"


def test_every_overlay_is_in_the_sizing_table() -> None:
    assert sorted(SIZING) == OVERLAYS


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_rendered_manifests_hold_every_invariant(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Namespace",
                                               "RayService", "Service"]
    rs = only(docs, "RayService")
    problems = rayservice_problems(rs, pinned_ray()) + secret_problems(docs) + reference_problems(docs)
    problems += telemetry_problems(docs) + requests_limits_problems(only(docs, "Deployment"))
    problems += image_problems(only(docs, "Deployment"))
    assert problems == []


@pytest.mark.parametrize("name", OVERLAYS)
def test_sizing_table(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    topology, accelerator, per_node, idle = SIZING[name]
    rs = only(rendered[name], "RayService")
    assert service_args(rs)["topology"] == topology
    spec = topology_spec(rs)
    (group,) = cluster(rs)["workerGroupSpecs"]
    node = ray_node_resources(group)
    assert node["GPU"] == GPUS_PER_NODE
    assert node[f"accelerator_type:{accelerator}"] == 1
    assert TOPOLOGIES[topology].accelerator == accelerator
    assert accelerator in group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    assert sessions_per_node(rs, group) == per_node
    assert GPUS_PER_NODE - per_node * spec.gpus == idle


def test_two_h100x5_sessions_never_share_a_node() -> None:
    """2 x h100x5 = 10 GPUs; STRICT_PACK needs them in one NVLink domain, and an H100 board has 8."""
    spec = bundles_for(TOPOLOGIES["h100x5"])
    assert 2 * spec.gpus == 10 > GPUS_PER_NODE
    node = {"GPU": 10.0, "CPU": 96.0, "accelerator_type:H100": 1.0}  # what a 2-session node would have to be
    assert free_bundles([NodeCapacity("n", free=node, total=node)], spec) == 2


def dockerfile_pins() -> dict[str, str]:
    text = (REPO / "docker" / "Dockerfile").read_text()
    pins = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    pins["FROM"] = re.findall(r"^FROM (\S+)", text, re.M)[-1]
    pins["USER"] = re.findall(r"^USER (\S+)$", text, re.M)[-1]
    return pins


def test_dockerfile_pins_agree_with_pyproject() -> None:
    """The image's Ray == the ray[serve] pin; pinned base and pip; it runs as a non-root user."""
    pins = dockerfile_pins()
    assert pins["RAY_VERSION"] == pinned_ray()
    base = pins["FROM"]
    assert "@sha256:" in base or re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", base), f"FROM {base}: pin it"
    assert re.fullmatch(r"python:3\.(11|12)\.\d+-\S+", base.split("@")[0]), f"FROM {base}: requires-python 3.11/3.12"
    setup_pip = re.search(r'"pip==([\d.]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert setup_pip and pins["PIP_VERSION"] == setup_pip[1]
    assert pins["USER"].split(":")[0] not in ("0", "root")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cudnn"]
    assert extra == [f"nvidia-cudnn-frontend=={pins['CUDNN_FRONTEND_VERSION']}"], extra


def test_rayservice_image_is_the_project_version(rendered: dict[str, list[dict[str, Any]]]) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name in OVERLAYS:
        rs = only(rendered[name], "RayService")
        pinned = re.compile(rf"([\w.:-]+/)*realtime-characters:{re.escape(version)}(@sha256:[0-9a-f]{{64}})?")
        assert all(pinned.fullmatch(c["image"]) for _, c in containers(rs)), [c["image"] for _, c in containers(rs)]
        assert cluster(rs)["rayVersion"] == pinned_ray()


# ----------------------------------------------------------------- every invariant catches a broken manifest


@pytest.fixture
def rs(rendered: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return copy.deepcopy(only(rendered["h100-h100x5"], "RayService"))


def head(rs: dict[str, Any]) -> dict[str, Any]:
    return cluster(rs)["headGroupSpec"]


def worker(rs: dict[str, Any]) -> dict[str, Any]:
    return cluster(rs)["workerGroupSpecs"][0]


def edit_serve_config(rs: dict[str, Any], edit: Any) -> None:
    config = serve_config(rs)
    edit(config["applications"][0], config)
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(config)


def test_schema_catches_unknown_wrong_typed_and_duplicate_fields(rs: dict[str, Any]) -> None:
    cluster(rs)["enableInTreeAutoScaling"] = True  # typo
    worker(rs)["minReplicas"] = "1"
    worker(rs)["maxReplicas"] = 2**31
    head(rs)["template"]["spec"]["containers"][0]["ports"].append({"name": "again", "containerPort": 8000})
    problems = schema_problems(rs)
    assert any("'enableInTreeAutoScaling' was unexpected" in p for p in problems)
    assert any("minReplicas: '1' is not of type 'integer'" in p for p in problems)
    assert any("maxReplicas: 2147483648 is not a 'int32'" in p for p in problems)
    assert any("duplicate entry" in p and "8000" in p for p in problems)


def test_schema_accepts_int_or_string(rs: dict[str, Any]) -> None:
    worker(rs)["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 96
    worker(rs)["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = 96
    assert schema_problems(rs) == []


def test_head_gpu_invariant(rs: dict[str, Any]) -> None:
    head(rs)["rayStartParams"]["num-gpus"] = "1"
    head(rs)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    assert head_gpu_problems(rs) == [
        "head rayStartParams num-gpus='1', must be \"0\"",
        "head container ray-head limits GPUs {'nvidia.com/gpu': '1'}; the head must have none",
    ]


def test_requests_limits_invariant(rs: dict[str, Any]) -> None:
    resources = worker(rs)["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["memory"] = "900Gi"
    del resources["limits"]["cpu"]
    assert requests_limits_problems(rs) == [
        "h100-8gpu/ray-worker: cpu must be in both requests and limits (requests={'cpu': '96', 'memory': '900Gi', "
        "'nvidia.com/gpu': '8'}, limits={'memory': '1000Gi', 'nvidia.com/gpu': '8'})",
        "h100-8gpu/ray-worker: memory requests 900Gi != limits 1000Gi",
        "h100-8gpu/ray-worker: resources ['cpu'] are in only one of requests/limits",
    ]


def test_bundle_fit_invariant(rs: dict[str, Any]) -> None:
    resources = worker(rs)["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = "4"
    assert len(bundle_fit_problems(rs)) == 1 and "does not hold one h100x5 session" in bundle_fit_problems(rs)[0]
    resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = "8"
    worker(rs)["resources"] = {"accelerator_type:B200": "1"}  # H100 topology on a B200 group
    assert "does not hold one h100x5 session" in bundle_fit_problems(rs)[0]


def test_ray_version_invariant(rs: dict[str, Any]) -> None:
    cluster(rs)["rayVersion"] = "2.59.0"
    assert ray_version_problems(rs, "2.60.0") == [
        "rayVersion='2.59.0' differs from the ray[serve]==2.60.0 pin in pyproject.toml"
    ]


def test_image_invariant(rs: dict[str, Any]) -> None:
    head(rs)["template"]["spec"]["containers"][0]["image"] = "realtime-characters:latest"
    worker(rs)["template"]["spec"]["containers"][0]["image"] = "registry.local:5000/realtime-characters"
    assert image_problems(rs) == [
        "head/ray-head: image 'realtime-characters:latest' uses :latest; pin a version or a digest",
        "h100-8gpu/ray-worker: image 'registry.local:5000/realtime-characters' has no tag or digest; pin one",
    ]
    worker(rs)["template"]["spec"]["containers"][0]["image"] = "r.io/x@sha256:" + "0" * 64
    assert len(image_problems(rs)) == 1


def test_secret_invariant(rs: dict[str, Any]) -> None:
    c = worker(rs)["template"]["spec"]["containers"][0]
    c["env"] = [e for e in c["env"] if e["name"] != "LIVEKIT_API_SECRET"]
    c["env"].append({"name": "LIVEKIT_API_SECRET", "value": "plain-text"})
    c["envFrom"].append({"secretRef": {"name": "everything"}})
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "characters-livekit"}, "data": {}}
    assert secret_problems([rs, secret]) == [
        "Secret characters-livekit is in the manifests; create it out of band (docs/kubernetes.md)",
        "h100-8gpu/ray-worker: envFrom.secretRef everything; use secretKeyRef",
        "h100-8gpu/ray-worker: LIVEKIT_API_SECRET is not from a secretKeyRef",
        "h100-8gpu/ray-worker: LIVEKIT_API_SECRET must come from a secretKeyRef",
    ]


def test_probe_invariant(rs: dict[str, Any]) -> None:
    c = worker(rs)["template"]["spec"]["containers"][0]
    del c["readinessProbe"]
    c["livenessProbe"]["httpGet"]["path"] = "/readyz"  # a liveness that fails while slots warm: restarts
    assert probe_problems(rs) == [
        "h100-8gpu/ray-worker: readinessProbe is None; need httpGet /readyz on 8000",
        "h100-8gpu/ray-worker: livenessProbe is {'path': '/readyz', 'port': 8000}; need httpGet /healthz on 8000",
    ]


def test_autoscaler_invariant(rs: dict[str, Any]) -> None:
    cluster(rs)["enableInTreeAutoscaling"] = False
    worker(rs)["maxReplicas"] = worker(rs)["minReplicas"]
    assert autoscaler_problems(rs) == [
        "enableInTreeAutoscaling=False, must be true",
        "worker group h100-8gpu: need minReplicas <= replicas <= maxReplicas and min < max to scale; got 2, 2, 2",
    ]


def test_warm_slot_invariant(rs: dict[str, Any]) -> None:
    edit_serve_config(rs, lambda app, _: app["args"]["service"].update(warm_slots=3))  # 2 min nodes x 1 session
    assert warm_slot_problems(rs) == ["warm_slots=3 exceeds the 2 sessions the minReplicas nodes hold"]


def test_upgrade_invariant(rs: dict[str, Any]) -> None:
    rs["spec"]["upgradeStrategy"] = {"type": "None"}
    rs["spec"]["rayClusterDeletionDelaySeconds"] = 60
    worker(rs)["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    del head(rs)["template"]["spec"]["containers"][0]["lifecycle"]
    edit_serve_config(rs, lambda app, _: app["deployments"][0]["user_config"].update(draining=True))
    assert upgrade_problems(rs) == [
        "CharactersIngress user_config.draining=True; a deployed service starts with false",
        "upgradeStrategy={'type': 'None'}; NewCluster keeps old sessions alive",
        "rayClusterDeletionDelaySeconds=60 < max_duration_s + queue_timeout_s = 930",
        "head: container ray-head has no preStop hook waiting for sessions",
        "h100-8gpu: terminationGracePeriodSeconds=30 < 930 + 30",
        "h100-8gpu: preStop --max-wait-s=960 must be within [930, 0] (longest session .. grace - margin)",
    ]


def test_serve_config_invariant(rs: dict[str, Any]) -> None:
    def edit(app: dict[str, Any], _config: dict[str, Any]) -> None:
        app["import_path"] = "deployments.api.app:app"
        del app["args"]["service"]["warm_slots"]
        del app["args"]["api"]
        del app["deployments"]

    edit_serve_config(rs, edit)
    assert serve_config_problems(rs) == [
        "application characters import_path='deployments.api.app:app', want deployments.api.app:build_app",
        "serveConfigV2 args lack ['service.warm_slots', 'api.max_duration_s']: the manifest must state them, "
        "not inherit defaults",
        "serveConfigV2 has no CharactersIngress user_config.draining (the drain switch)",
    ]
    edit_serve_config(rs, lambda _app, config: config["http_options"].update(port="eight thousand"))
    assert "not a valid Serve config" in serve_config_problems(rs)[0]


def test_builder_invariant(rs: dict[str, Any]) -> None:
    def edit(app: dict[str, Any], config: dict[str, Any]) -> None:
        app["args"]["service"]["topology"] = "h100x6"
        app["args"]["draining"] = False  # not an arg of build_app: a user_config of its ingress
        del config["grpc_options"]

    edit_serve_config(rs, edit)
    problems = builder_problems(rs)
    assert len(problems) == 2
    assert problems[0].startswith("deployments.api.app.parse_args refuses the serveConfigV2 args: unknown app args "
                                  "['draining']")
    assert problems[1] == ("grpc_options.grpc_servicer_functions=None, want "
                           "['deployments.api.proto.characters_pb2_grpc.add_CharactersServicer_to_server']")


def test_reference_and_telemetry_invariants(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["h100-h100x5"])
    docs = [d for d in docs if not d["metadata"]["name"].startswith("characters-prestop")]
    env = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("characters-env"))
    env["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://otel-collector:9999"
    rs = only(docs, "RayService")
    worker(rs)["template"]["metadata"]["annotations"]["prometheus.io/scrape"] = "false"
    refs = reference_problems(docs)
    assert len(refs) == 2 and all("characters-prestop-" in p and "is not in the manifests" in p for p in refs)
    telemetry = telemetry_problems(docs)
    assert telemetry[0] == (
        "OTEL_EXPORTER_OTLP_ENDPOINT='http://otel-collector:9999' names no Service port in the manifests")
    assert telemetry[1].startswith("h100-8gpu: Prometheus annotations") and len(telemetry) == 2


# ------------------------------------------------------------------------------------------- the collector


def test_the_shipped_collector_config_validates_on_the_release_the_manifests_pin() -> None:
    """tools/otelcol (the collector the telemetry test runs) is built from the release the manifests' image
    pins, and the shipped config validates on it (every component it names exists, every field is known)."""
    image = next(c["image"] for d in yaml.safe_load_all((K8S / "base" / "otel-collector.yaml").read_text())
                 if d and d.get("kind") == "Deployment" for c in d["spec"]["template"]["spec"]["containers"])
    release = re.fullmatch(r"otel/opentelemetry-collector-contrib:(\d+\.\d+)\.\d+", image)
    assert release, image
    gomod = (REPO / "tools" / "otelcol" / "go.mod").read_text()
    pinned = set(re.findall(r"(?:go\.opentelemetry\.io/collector|opentelemetry-collector-contrib)/\S+ v0\.(\d+)\.\d+",
                            gomod))
    assert pinned == {release.group(1).split(".")[1]}, (image, pinned)
    built = subprocess.run([str(REPO / "scripts" / "setup" / "install_otelcol.sh")], capture_output=True, text=True,
                           timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    binary = built.stdout.strip().splitlines()[-1]
    check = subprocess.run([binary, "validate", f"--config={K8S / 'base' / 'otel-collector-config.yaml'}"],
                           capture_output=True, text=True, timeout=60, env={"TRACES_BACKEND_ENDPOINT": "tempo:4317"})
    assert check.returncode == 0, check.stderr[-3000:]
