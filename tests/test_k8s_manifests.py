"""The Kubernetes manifests (deploy/k8s/) are valid objects, and refer only to things that
exist: settings, modules, routes, ports, keys of the Secret, the dashboard file, and one
another. No cluster, kubectl or kustomize runs here: core kinds are checked with
kubernetes-validate's strict schemas, the Gateway API and Inference Extension kinds with
the CRD schemas of their releases (tests/data/crds/NOTICE.md), and every cross-reference
by the checks below.

Each check comes with a planted bad input, so a check that silently sees nothing cannot
pass for clean manifests."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from custody.cli import build_parser
from shared.config import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CRDS = ROOT / "tests" / "data" / "crds"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "custody-pool-health.json"
KUSTOMIZATION = "kustomization.yaml"
# The newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships.
K8S_VERSION = "1.37"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Keys that would make the kustomization more than a list of plain files.
NOT_PLAIN = frozenset(
    {
        "patches",
        "patchesStrategicMerge",
        "patchesJson6902",
        "configMapGenerator",
        "secretGenerator",
        "generators",
        "transformers",
        "components",
    }
)
# CUSTODY_* variables that are not settings: the preStop hook's own (custody drain --url).
NOT_SETTINGS = frozenset({"CUSTODY_DRAIN_URL"})
# Where each (python -m module, port) serves its HTTP routes and gRPC health services: a
# path or service is served when its quoted literal appears in those sources.
ANY_PATH = "any path"  # services/executor/metrics_http.py answers every GET
APP_SOURCES: dict[tuple[str, int], tuple[str, ...] | str] = {
    ("custody.replica", 30000): ("services/scheduler/http/routes.py",),
    ("custody.replica", 30002): ANY_PATH,
    ("services.session_store.service", 30001): ("services/session_store/service.py",),
    ("services.router.main", 30000): ("services/router/app.py",),
    ("services.epp.main", 9003): ("services/epp/**/*.py",),
    ("services.epp.main", 9090): ("services/epp/**/*.py",),
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


# ---- loading ----


@cache
def manifest_files() -> tuple[str, ...]:
    return tuple(sorted(p.name for p in K8S.iterdir() if p.is_file()))


@cache
def _load(name: str) -> tuple[dict, ...]:
    return tuple(d for d in yaml.load_all((K8S / name).read_text(), Loader=LOADER) if d)


def objects() -> Iterator[tuple[str, dict]]:
    """(file, object) for every object of every manifest but the kustomization."""
    for name in manifest_files():
        if name != KUSTOMIZATION:
            for obj in _load(name):
                yield name, obj


def every_object() -> list[dict]:
    return [obj for _, obj in objects()]


def the(kind: str, name: str, objs: list[dict] | None = None) -> dict:
    objs = every_object() if objs is None else objs
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def group_of(obj: dict) -> str:
    return obj["apiVersion"].rpartition("/")[0]


@cache
def crds() -> dict[tuple[str, str], dict]:
    """(group, kind) -> its CRD, for every CRD in tests/data/crds/ (copied verbatim from
    their releases: NOTICE.md there)."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=LOADER)
        found[crd["spec"]["group"], crd["spec"]["names"]["kind"]] = crd
    return found


def is_crd_kind(obj: dict) -> bool:
    return (group_of(obj), obj["kind"]) in crds()


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def selects(match_labels: dict, labels: dict) -> bool:
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def port_number(container: dict, port: int | str) -> int | None:
    """A probe's or Service's port, named or numbered, as the container's port number."""
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def module_of(container: dict) -> str | None:
    """The module of a `python -m <module>` command, else None."""
    cmd = container.get("command", [])
    if len(cmd) >= 3 and cmd[0].startswith("python") and cmd[1] == "-m":
        return cmd[2]
    return None


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# ---- (a) every manifest parses; core kinds validate strictly ----


def test_every_manifest_parses_to_named_namespace_less_objects():
    names = manifest_files()
    assert KUSTOMIZATION in names and len(names) > 10
    assert all(n.endswith(".yaml") for n in names), names
    found = list(objects())
    assert len(found) > 15
    for name, obj in found:
        assert {"apiVersion", "kind", "metadata"} <= set(obj), name
        assert obj["metadata"].get("name"), name
        # namespace-less, so `kubectl apply -n` or kustomize's `namespace:` places them
        assert "namespace" not in obj["metadata"], (name, obj["metadata"])


def core_objects() -> list[tuple[str, dict]]:
    return [(n, o) for n, o in objects() if not is_crd_kind(o)]


@pytest.mark.parametrize(
    "name,obj",
    core_objects(),
    ids=[f"{n}:{o['kind']}/{o['metadata']['name']}" for n, o in core_objects()],
)
def test_core_objects_validate_strictly(name: str, obj: dict):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_refuses_an_unknown_field_and_a_wrong_type():
    statefulset = the("StatefulSet", "custody-replica")
    unknown = copy.deepcopy(statefulset)
    unknown["spec"]["template"]["spec"]["containers"][0]["commandd"] = ["python"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, K8S_VERSION, strict=True)
    wrong = copy.deepcopy(statefulset)
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "120"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


# ---- (b) the Gateway API and Inference Extension kinds against their CRDs ----


def closed(schema: dict) -> dict:
    """The schema with unknown fields refused, as the API server's strict field
    validation (kubectl's default) refuses them: `additionalProperties: false` on every
    structural object schema with `properties`, unless it preserves unknown fields.
    Logical junctors (allOf, anyOf, oneOf, not) only restrict, so they stay as they are.
    `x-kubernetes-*` keys (CEL rules among them) mean nothing to jsonschema."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            schema["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        schema["items"] = closed(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = closed(schema["additionalProperties"])
    return schema


@cache
def crd_validator(group: str, kind: str, version: str) -> jsonschema.Draft7Validator:
    crd = crds()[group, kind]
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert served, f"{group}/{version} {kind} is not a served version of its CRD"
    return jsonschema.Draft7Validator(closed(served[0]["schema"]["openAPIV3Schema"]))


def crd_errors(obj: dict) -> list[str]:
    version = obj["apiVersion"].rpartition("/")[2]
    validator = crd_validator(group_of(obj), obj["kind"], version)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def test_gateway_api_and_inference_objects_validate_against_their_crds():
    found = [o for _, o in objects() if is_crd_kind(o)]
    assert {o["kind"] for o in found} == {"InferencePool", "HTTPRoute", "Gateway"}
    for obj in found:
        assert crd_errors(obj) == [], (obj["kind"], obj["metadata"]["name"])


def test_crd_validation_refuses_unknown_fields_bad_values_and_missing_fields():
    pool = copy.deepcopy(the("InferencePool", "custody"))
    pool["spec"]["targetPort"] = 30000
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    problems = crd_errors(pool)
    assert any("targetPort" in p for p in problems), problems
    assert any("FailSometimes" in p for p in problems), problems
    gateway = copy.deepcopy(the("Gateway", "custody-gateway"))
    del gateway["spec"]["listeners"]
    assert any("listeners" in p for p in crd_errors(gateway))
    route = copy.deepcopy(the("HTTPRoute", "custody"))
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    assert any("weight" in p for p in crd_errors(route))


# ---- (c) the kustomization lists every manifest, plainly ----


def kustomization_problems(kustomization: dict, files: tuple[str, ...]) -> list[str]:
    problems = [f"has {key}" for key in sorted(NOT_PLAIN & set(kustomization))]
    listed = kustomization.get("resources", [])
    problems += [f"{r} listed twice" for r in sorted({r for r in listed if listed.count(r) > 1})]
    wanted = set(files) - {KUSTOMIZATION}
    problems += [f"{f} not listed" for f in sorted(wanted - set(listed))]
    problems += [f"{r} is not a file here" for r in sorted(set(listed) - wanted)]
    return problems


def test_the_kustomization_lists_every_manifest_once_and_nothing_else():
    (kustomization,) = _load(KUSTOMIZATION)
    assert kustomization["kind"] == "Kustomization"
    assert kustomization_problems(kustomization, manifest_files()) == []


def test_the_kustomization_check_flags_a_missing_a_repeated_and_a_generated_file():
    files = ("a.yaml", "b.yaml", "c.yaml", KUSTOMIZATION)
    bad = {"resources": ["a.yaml", "a.yaml", "gone.yaml"], "configMapGenerator": []}
    assert kustomization_problems(bad, files) == [
        "has configMapGenerator",
        "a.yaml listed twice",
        "b.yaml not listed",
        "c.yaml not listed",
        "gone.yaml is not a file here",
    ]


# ---- (d) cross-references ----


def setting_variables() -> set[str]:
    return {f"CUSTODY_{f.name.upper()}" for f in dataclasses.fields(Settings)}


def variable_problems(objs: list[dict]) -> list[str]:
    """CUSTODY_* variables that are no setting; variables an exec command reads that its
    container does not define; exempt variables no exec command reads (dead)."""
    settings = setting_variables()
    problems = []
    for secret in (o for o in objs if o["kind"] == "Secret"):
        for key in secret.get("stringData", {}):
            if key.startswith("CUSTODY_") and key not in settings:
                problems.append(f"Secret {secret['metadata']['name']}: {key} is no setting")
    for workload in workloads(objs):
        for c in containers(workload):
            where = f"{workload['metadata']['name']}/{c['name']}"
            env = env_of(c)
            execs = [c.get("lifecycle", {}).get("preStop", {}), *(c.get(p, {}) for p in PROBES)]
            read = {
                v
                for handler in execs
                for arg in handler.get("exec", {}).get("command", [])
                for v in re.findall(r"\$\{?([A-Za-z_]\w*)", arg)
            }
            for name in env:
                if name in NOT_SETTINGS:
                    if name not in read:
                        problems.append(f"{where}: {name} is read by no exec command")
                elif name.startswith("CUSTODY_") and name not in settings:
                    problems.append(f"{where}: {name} is no setting")
            problems += [f"{where}: {v} is not in its env" for v in sorted(read - set(env))]
    return problems


def test_every_custody_variable_is_a_setting_and_every_exec_variable_is_defined():
    objs = every_object()
    assert variable_problems(objs) == []


def test_the_variable_check_flags_an_unknown_setting_and_an_undefined_variable():
    objs = [copy.deepcopy(the("StatefulSet", "custody-replica"))]
    (replica,) = pod_spec(objs[0])["containers"]
    replica["env"].append({"name": "CUSTODY_NO_SUCH_SETTING", "value": "1"})
    replica["env"] = [e for e in replica["env"] if e["name"] != "CUSTODY_DRAIN_URL"]
    assert variable_problems(objs) == [
        "custody-replica/replica: CUSTODY_NO_SUCH_SETTING is no setting",
        "custody-replica/replica: CUSTODY_DRAIN_URL is not in its env",
    ]


def secret_problems(objs: list[dict]) -> list[str]:
    """Secret references naming no Secret, or no key of it; placeholders that are not."""
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    problems = [
        f"Secret {name}: {key} is not a CHANGE-ME placeholder"
        for name, secret in secrets.items()
        for key, value in secret.get("stringData", {}).items()
        if "CHANGE-ME" not in value
    ]
    for workload in workloads(objs):
        for c in containers(workload):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                keys = secrets.get(ref["name"], {}).get("stringData", {})
                if ref["key"] not in keys:
                    problems.append(f"{c['name']}: {e['name']} <- {ref['name']}/{ref['key']}")
    return problems


def test_every_secret_reference_names_a_key_of_the_secret_template():
    objs = every_object()
    assert secret_problems(objs) == []


def test_the_secret_check_flags_a_missing_key_and_a_real_looking_secret():
    secret = copy.deepcopy(the("Secret", "custody-secrets"))
    secret["stringData"]["CUSTODY_API_KEYS"] = "sk-live-123"
    store = copy.deepcopy(the("Deployment", "custody-session-store"))
    (container,) = pod_spec(store)["containers"]
    container["env"][1]["valueFrom"]["secretKeyRef"]["key"] = "CUSTODY_REDIS"
    assert secret_problems([secret, store]) == [
        "Secret custody-secrets: CUSTODY_API_KEYS is not a CHANGE-ME placeholder",
        "session-store: CUSTODY_REDIS_URL <- custody-secrets/CUSTODY_REDIS",
    ]


def module_problem(module: str) -> str | None:
    """None when `python -m module` runs a file of this repository that the image holds."""
    base = ROOT.joinpath(*module.split("."))
    if not (base.with_suffix(".py").exists() or (base / "__main__.py").exists()):
        return f"{module}: no {base.relative_to(ROOT)}.py or __main__.py"
    copied = re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M)
    if module.split(".")[0] not in copied:
        return f"{module}: the Dockerfile does not copy {module.split('.')[0]}/"
    return None


def test_every_python_module_command_resolves_to_a_module_of_the_image():
    modules = {module_of(c) for w in workloads(every_object()) for c in containers(w)} - {None}
    assert {"custody.replica", "services.router.main"} <= modules
    assert [p for m in sorted(modules) if (p := module_problem(m))] == []


def test_the_module_check_flags_a_missing_module():
    assert module_problem("services.no_such.main") is not None
    assert module_problem("services.router") is not None  # a package without __main__
    assert module_problem("custody.replica") is None


def served(module: str | None, port: int | None, literal: str) -> str | None:
    """None when the app behind `python -m module` on `port` serves the path (or gRPC
    health service) `literal`, else why not."""
    sources = APP_SOURCES.get((module, port))
    if sources is None:
        return f"no known app of {module} on port {port}"
    if sources == ANY_PATH:
        return None
    files = [p for pattern in sources for p in sorted(ROOT.glob(pattern))]
    if not files:
        return f"{module} on {port}: none of {sources} exists"
    if not any(f'"{literal}"' in p.read_text() for p in files):
        return f"{module} on {port}: {literal} is not served"
    return None


def path_problems(objs: list[dict]) -> list[str]:
    """Every probe's path or gRPC service, and every scrape annotation's path, is one the
    app behind that port serves."""
    problems = []
    for workload in workloads(objs):
        pods = workload["spec"]["template"]["metadata"].get("annotations", {})
        for c in containers(workload):
            module = module_of(c)
            asked = []
            for probe in (c.get(p) for p in PROBES):
                if probe and "httpGet" in probe:
                    asked.append((probe["httpGet"]["port"], probe["httpGet"]["path"]))
                if probe and "grpc" in probe:
                    asked.append((probe["grpc"]["port"], probe["grpc"]["service"]))
            if pods.get("prometheus.io/scrape") == "true":
                port = int(pods["prometheus.io/port"])
                if port_number(c, port) is not None:
                    asked.append((port, pods["prometheus.io/path"]))
            for port, literal in asked:
                if (problem := served(module, port_number(c, port), literal)) is not None:
                    problems.append(f"{workload['metadata']['name']}: {problem}")
    return problems


def test_probe_and_scrape_paths_are_routes_the_services_serve():
    custody = [c for w in workloads(every_object()) for c in containers(w) if module_of(c)]
    assert [c["name"] for c in custody if "readinessProbe" not in c] == []
    assert path_problems(every_object()) == []


def test_the_path_check_flags_a_route_no_service_serves():
    store = copy.deepcopy(the("Deployment", "custody-session-store"))
    (container,) = pod_spec(store)["containers"]
    container["livenessProbe"]["httpGet"]["path"] = "/healthz"
    assert path_problems([store]) == [
        "custody-session-store: services.session_store.service on 30001: /healthz is not served"
    ]
    assert served("custody.replica", 30000, "/liveness") is None
    assert served("custody.replica", 30001, "/health") is not None  # no app there


def test_the_grafana_configmap_holds_the_dashboard_file_verbatim():
    configmap = the("ConfigMap", "custody-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    # a panel edited in one copy only is caught, down to its whitespace
    drifted = configmap["data"][DASHBOARD.name].replace("\n", " \n", 1)
    assert {DASHBOARD.name: drifted} != {DASHBOARD.name: DASHBOARD.read_text()}


def service_problems(objs: list[dict]) -> list[str]:
    """Each Service selects the pods of exactly one workload, and each of its ports
    targets a port of that workload's containers."""
    problems = []
    for svc in (o for o in objs if o["kind"] == "Service"):
        name = svc["metadata"]["name"]
        chosen = [w for w in workloads(objs) if selects(svc["spec"]["selector"], pod_labels(w))]
        if len(chosen) != 1:
            problems.append(f"Service {name} selects {len(chosen)} workloads")
            continue
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if not any(port_number(c, target) for c in containers(chosen[0])):
                problems.append(f"Service {name}: no container port {target}")
    return problems


def test_every_service_selects_one_workload_and_targets_its_ports():
    objs = every_object()
    assert service_problems(objs) == []
    statefulset = the("StatefulSet", "custody-replica")
    assert statefulset["spec"]["serviceName"] == "custody-replica"
    assert the("Service", "custody-replica", objs)["spec"]["clusterIP"] == "None"


def test_the_service_check_flags_a_wrong_selector_and_a_missing_port():
    objs = copy.deepcopy(every_object())
    the("Service", "custody-epp", objs)["spec"]["ports"][0]["targetPort"] = "grpc"
    the("Service", "custody-router", objs)["spec"]["selector"] = {"app": "router"}
    assert service_problems(objs) == [
        "Service custody-epp: no container port grpc",
        "Service custody-router selects 0 workloads",
    ]


def link_problems(objs: list[dict]) -> list[str]:
    """Pods that run custody with Service links on: Kubernetes would add
    CUSTODY_<SERVICE>_PORT=tcp://... variables (custody-session-store's, say), which
    custody reads as settings once one matches a setting's name."""
    return [
        w["metadata"]["name"]
        for w in workloads(objs)
        if any(module_of(c) for c in containers(w))
        and pod_spec(w).get("enableServiceLinks") is not False
    ]


def test_custody_pods_turn_service_links_off():
    assert link_problems(every_object()) == []
    router = copy.deepcopy(the("Deployment", "custody-router"))
    del pod_spec(router)["enableServiceLinks"]
    assert link_problems([router]) == ["custody-router"]


def pool_problems(objs: list[dict]) -> list[str]:
    """The InferencePool selects exactly the replica pods, on their API port, with the
    EPP's ext_proc port as its picker."""
    pool = the("InferencePool", "custody", objs)
    replica = the("StatefulSet", "custody-replica", objs)
    (container,) = pod_spec(replica)["containers"]
    problems = []
    match = pool["spec"]["selector"]["matchLabels"]
    chosen = [w["metadata"]["name"] for w in workloads(objs) if selects(match, pod_labels(w))]
    if chosen != ["custody-replica"]:
        problems.append(f"the pool selects {chosen}")
    targets = [p["number"] for p in pool["spec"]["targetPorts"]]
    if targets != [port_number(container, "http")]:
        problems.append(f"the pool targets {targets}")
    picker = pool["spec"]["endpointPickerRef"]
    epp = the("Service", picker["name"], objs)
    ports = {p["port"]: p for p in epp["spec"]["ports"]}
    if ports.get(picker["port"]["number"], {}).get("targetPort") != "grpc-ext-proc":
        problems.append(f"the picker port {picker['port']['number']} is not ext_proc")
    if picker.get("failureMode") != "FailClose":
        problems.append("the picker fails open")
    return problems


def test_the_pool_selects_the_replica_pods_on_their_api_port():
    assert pool_problems(every_object()) == []


def test_the_pool_check_flags_a_wrong_selector_port_and_picker():
    objs = copy.deepcopy(every_object())
    pool = the("InferencePool", "custody", objs)
    pool["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "custody"}
    pool["spec"]["targetPorts"] = [{"number": 30002}]
    pool["spec"]["endpointPickerRef"]["port"]["number"] = 9090
    assert pool_problems(objs) == [
        "the pool selects ['custody-epp', 'custody-redis', 'custody-replica', "
        "'custody-router', 'custody-session-store']",
        "the pool targets [30002]",
        "the picker port 9090 is not ext_proc",
    ]


def route_problems(objs: list[dict]) -> list[str]:
    route = the("HTTPRoute", "custody", objs)
    problems = []
    gateways = {o["metadata"]["name"] for o in objs if o["kind"] == "Gateway"}
    for parent in route["spec"]["parentRefs"]:
        if parent.get("kind", "Gateway") != "Gateway" or parent["name"] not in gateways:
            problems.append(f"parent {parent['name']} is no Gateway here")
    pools = {o["metadata"]["name"] for o in objs if o["kind"] == "InferencePool"}
    for rule in route["spec"]["rules"]:
        for ref in rule["backendRefs"]:
            is_pool = (ref.get("group"), ref.get("kind")) == (
                "inference.networking.k8s.io",
                "InferencePool",
            )
            if not is_pool or ref["name"] not in pools:
                problems.append(f"backend {ref.get('kind')}/{ref['name']} is no InferencePool")
    return problems


def test_the_route_sends_everything_to_the_pool_through_the_gateway():
    assert route_problems(every_object()) == []


def test_the_route_check_flags_a_service_backend_and_a_missing_gateway():
    objs = copy.deepcopy(every_object())
    route = the("HTTPRoute", "custody", objs)
    route["spec"]["rules"][0]["backendRefs"] = [{"name": "custody-replica", "port": 30000}]
    route["spec"]["parentRefs"][0]["name"] = "other-gateway"
    assert route_problems(objs) == [
        "parent other-gateway is no Gateway here",
        "backend None/custody-replica is no InferencePool",
    ]


def scaling_problems(objs: list[dict]) -> list[str]:
    """The replicas' PodDisruptionBudget and HorizontalPodAutoscaler aim at the replica
    StatefulSet, which leaves its replica count to the autoscaler."""
    replica = the("StatefulSet", "custody-replica", objs)
    problems = []
    pdb = the("PodDisruptionBudget", "custody-replica", objs)
    if pdb["spec"]["selector"] != replica["spec"]["selector"]:
        problems.append("the PDB selects other pods")
    if pdb["spec"].get("maxUnavailable") != 1:
        problems.append("the PDB allows more than one replica down")
    hpa = the("HorizontalPodAutoscaler", "custody-replica", objs)
    target = hpa["spec"]["scaleTargetRef"]
    if (target["apiVersion"], target["kind"], target["name"]) != (
        "apps/v1",
        "StatefulSet",
        "custody-replica",
    ):
        problems.append(f"the HPA scales {target['kind']}/{target['name']}")
    metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    if metrics != ["custody_requests_queued"]:
        problems.append(f"the HPA reads {metrics}")
    if "replicas" in replica["spec"]:
        problems.append("the StatefulSet sets replicas: every apply would undo the HPA")
    return problems


def test_the_disruption_budget_and_autoscaler_target_the_replica_statefulset():
    assert scaling_problems(every_object()) == []


def test_the_scaling_check_flags_a_wrong_target():
    objs = copy.deepcopy(every_object())
    the("HorizontalPodAutoscaler", "custody-replica", objs)["spec"]["scaleTargetRef"]["kind"] = (
        "Deployment"
    )
    the("PodDisruptionBudget", "custody-replica", objs)["spec"]["selector"] = {
        "matchLabels": {"app.kubernetes.io/component": "epp"}
    }
    the("StatefulSet", "custody-replica", objs)["spec"]["replicas"] = 2
    assert scaling_problems(objs) == [
        "the PDB selects other pods",
        "the HPA scales Deployment/custody-replica",
        "the StatefulSet sets replicas: every apply would undo the HPA",
    ]


def replica_problems(objs: list[dict]) -> list[str]:
    """A replica's identity, state volume, compile cache, address and drain, wired as
    custody.replica and the drain need them."""
    replica = the("StatefulSet", "custody-replica", objs)
    spec = pod_spec(replica)
    (c,) = spec["containers"]
    env = env_of(c)
    value = {name: e.get("value") for name, e in env.items()}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    problems = []
    if value.get("CUSTODY_REPLICA") != "auto":
        problems.append("the replica id does not follow the pod name")
    if module_of(c) != "custody.replica":
        problems.append("the container is not custody.replica")
    # the disk tier on the RWX claim every replica mounts
    state = [n for n, path in mounts.items() if path == value.get("CUSTODY_STATE_DIR")]
    claim = volumes.get(state[0], {}).get("persistentVolumeClaim", {}) if state else {}
    pvcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PersistentVolumeClaim"}
    if "ReadWriteMany" not in pvcs.get(claim.get("claimName"), {}).get("spec", {}).get(
        "accessModes", []
    ):
        problems.append("CUSTODY_STATE_DIR is not on a ReadWriteMany claim")
    templates = {t["metadata"]["name"] for t in replica["spec"].get("volumeClaimTemplates", [])}
    cache_dir = value.get("TORCHINDUCTOR_CACHE_DIR")
    if not any(path == cache_dir and n in templates | set(volumes) for n, path in mounts.items()):
        problems.append("TORCHINDUCTOR_CACHE_DIR is on no volume")
    field = env.get("CUSTODY_ADVERTISE_HOST", {}).get("valueFrom", {}).get("fieldRef", {})
    if field.get("fieldPath") != "status.podIP":
        problems.append("the replica does not advertise its pod IP")
    # the drain: the preStop hook drains this pod through CUSTODY_DRAIN_URL, which names
    # the EPP's admin port, where the EPP serves POST /admin/drain
    drain = prestop_drain(c)
    if isinstance(drain, str):
        problems.append(drain)
    elif spec.get("terminationGracePeriodSeconds", 30) <= drain.timeout:
        problems.append("the grace period ends before the drain's own timeout")
    problems += drain_target_problems(value.get("CUSTODY_DRAIN_URL", ""), objs)
    return problems


def prestop_drain(container: dict) -> argparse.Namespace | str:
    """The preStop hook's `custody drain` as the custody command parses it, else why not."""
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if not command or command[:2] != ["sh", "-c"]:
        return f"the preStop hook is not a shell command: {command}"
    words = shlex.split(command[2])
    try:
        args = build_parser().parse_args(words[1:])
    except SystemExit:
        return f"custody cannot parse the preStop hook: {command[2]}"
    if (words[0], args.command) != ("custody", "drain"):
        return f"the preStop hook does not drain: {command[2]}"
    if (args.url, args.replica) != ("$CUSTODY_DRAIN_URL", "$(hostname)"):
        return f"the preStop hook drains {args.replica} through {args.url}"
    return args


def drain_target_problems(url: str, objs: list[dict]) -> list[str]:
    """`url` names a Service port whose pods serve POST /admin/drain there."""
    parts = urlsplit(url)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    svc = services.get(parts.hostname or "")
    port = next((p for p in svc["spec"]["ports"] if p["port"] == parts.port), None) if svc else None
    if port is None:
        return [f"the drain URL {url} names no Service port"]
    (workload,) = [w for w in workloads(objs) if selects(svc["spec"]["selector"], pod_labels(w))]
    (c,) = pod_spec(workload)["containers"]
    problem = served(module_of(c), port_number(c, port["targetPort"]), "/admin/drain")
    return [] if problem is None else [f"the drain URL {url}: {problem}"]


def test_the_replicas_identity_state_address_and_drain_are_wired():
    objs = every_object()
    assert replica_problems(objs) == []
    # the documented alternative: clusters on the custody router drain through it
    assert drain_target_problems("http://custody-router:30000", objs) == []


def test_the_replica_check_flags_a_private_state_dir_and_a_wrong_drain_url():
    objs = copy.deepcopy(every_object())
    replica = the("StatefulSet", "custody-replica", objs)
    pod_spec(replica)["volumes"] = [{"name": "session-state", "emptyDir": {}}]
    (c,) = pod_spec(replica)["containers"]
    for e in c["env"]:
        if e["name"] == "CUSTODY_DRAIN_URL":
            e["value"] = "http://custody-epp:9002"
    c["lifecycle"]["preStop"]["exec"]["command"][2] += " --timeout 130"
    assert replica_problems(objs) == [
        "CUSTODY_STATE_DIR is not on a ReadWriteMany claim",
        "the grace period ends before the drain's own timeout",
        "the drain URL http://custody-epp:9002: no known app of services.epp.main on port 9002",
    ]


def test_redis_keeps_an_append_only_file_and_the_url_names_its_service():
    objs = every_object()
    redis = the("StatefulSet", "custody-redis", objs)
    (c,) = pod_spec(redis)["containers"]
    args = c["args"]
    assert args[0] == "redis-server" and "command" not in c  # the entrypoint drops root
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "REDIS_PASSWORD" in env_of(c)
    url = urlsplit(the("Secret", "custody-secrets", objs)["stringData"]["CUSTODY_REDIS_URL"])
    svc = the("Service", url.hostname, objs)
    assert url.port in [p["port"] for p in svc["spec"]["ports"]]
    assert selects(svc["spec"]["selector"], pod_labels(redis))


def test_the_prestop_check_flags_a_command_custody_cannot_parse():
    replica = copy.deepcopy(the("StatefulSet", "custody-replica"))
    (c,) = pod_spec(replica)["containers"]
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    hook[2] = hook[2].replace("--replica", "--replicas")
    assert prestop_drain(c) == f"custody cannot parse the preStop hook: {hook[2]}"
    hook[2] = 'custody drain --url "$CUSTODY_DRAIN_URL" --replica custody-replica-0'
    assert prestop_drain(c) == (
        "the preStop hook drains custody-replica-0 through $CUSTODY_DRAIN_URL"
    )
