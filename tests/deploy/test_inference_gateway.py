"""deploy/k8s/inference-gateway against the published CRD schemas, offline: each InferencePool, Gateway and
HTTPRoute is defaulted and validated as the API server would (OpenAPI schema with unknown fields refused,
then every CEL rule of the schema on the object's nodes), and the pieces point at each other: the pool
selects the tailserve replica pods on their port, its picker is the EPP's Service, the EPP serves that
pool with the mounted config, the route sends to the pool. Schemas: tests/deploy/crd_schemas (copied by
scripts/k8s_crd_schemas.py from the upstream tags it names)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import build_parser

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
celpy = pytest.importorskip("celpy")

REPO = Path(__file__).resolve().parents[2]
GATEWAY_DIR = REPO / "deploy" / "k8s" / "inference-gateway"
SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# CEL names that a Kubernetes schema's property must be escaped as (apiextensions' rules).
CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}  # fmt: skip


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(GATEWAY_DIR.glob("*.yaml")):
        for doc in _docs(path):
            if "metadata" in doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the vendored CRD schema file."""
    crds = {}
    for path in SCHEMAS.glob("*.json"):
        crd = json.loads(path.read_text())
        crds[(f"{crd['group']}/{crd['version']}", crd["kind"])] = crd
    return crds


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    """The object after structural defaulting: a missing property with a `default` gets it."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {
            k: _defaulted(props.get(k, schema.get("additionalProperties") or {}), v) for k, v in value.items()
        }
        for name, sub in props.items():
            if name not in out and "default" in sub:
                out[name] = _defaulted(sub, sub["default"])
        return out
    if isinstance(value, list):
        return [_defaulted(schema.get("items", {}), v) for v in value]
    return value


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server would prune them (an object with
    properties, no additionalProperties, no x-kubernetes-preserve-unknown-fields): kubectl's strict
    field validation reports those as errors."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_ended:
        out["additionalProperties"] = False
    return out


def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """A node as CEL sees it: properties named like CEL keywords are escaped (`__namespace__`)."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if props is None:
            return {k: _cel_value(schema.get("additionalProperties") or {}, v) for k, v in value.items()}
        return {
            (f"__{k}__" if k in CEL_RESERVED else k): _cel_value(props.get(k, {}), v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_cel_value(schema.get("items", {}), v) for v in value]
    return value


def _cel_failures(schema: dict[str, Any], value: Any, where: str) -> tuple[int, list[str]]:
    """(rules evaluated, the ones that are false or cannot be evaluated) over every node present."""
    count, failures = 0, []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        count += 1
        try:
            program = env.program(env.compile(rule["rule"]))
            ok = program.evaluate({"self": celpy.json_to_cel(_cel_value(schema, value))})
        except Exception as exc:  # an error is a failure too: the API server would refuse the object
            failures.append(f"{where}: {rule['rule'][:80]!r} could not be evaluated ({type(exc).__name__})")
            continue
        if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            failures.append(f"{where}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in value.items():
            child = schema.get("properties", {}).get(key, schema.get("additionalProperties") or {})
            n, f = _cel_failures(child, sub, f"{where}.{key}")
            count, failures = count + n, failures + f
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            n, f = _cel_failures(schema.get("items", {}), sub, f"{where}[{i}]")
            count, failures = count + n, failures + f
    return count, failures


def _check_against_crd(obj: dict[str, Any], crd: dict[str, Any]) -> int:
    """Validate one object as the API server would; returns how many CEL rules it went through."""
    schema = crd["schema"]
    obj = _defaulted(schema, obj)
    errors = sorted(jsonschema.Draft4Validator(_strict(schema)).iter_errors(obj), key=str)
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    count, failures = _cel_failures(schema, obj, obj["kind"])
    assert not failures, failures
    return count


def test_every_custom_resource_is_valid_against_its_published_crd() -> None:
    crds = _crds()
    checked = {}
    for (kind, name), obj in _objects().items():
        assert DNS_SUBDOMAIN.fullmatch(name), name
        key = (obj["apiVersion"], kind)
        if key in crds:
            checked[kind] = _check_against_crd(obj, crds[key])
    assert set(checked) == {"InferencePool", "Gateway", "HTTPRoute"}
    assert checked["InferencePool"] == 2  # its two rules: picker port set, target ports unique


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda p: p["spec"].pop("selector"), "'selector' is a required property"),
        (lambda p: p["spec"].update(targetPorts=[]), "should be non-empty"),
        (lambda p: p["spec"]["targetPorts"].append({"number": 8000}), "port number must be unique"),
        (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required"),
        (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"), "is not one of"),
        (lambda p: p["spec"].update(targetPort=8000), "Additional properties"),
    ],
)
def test_the_checker_refuses_a_broken_pool(change: Any, complaint: str) -> None:
    """The validation above is not vacuous: each of these edits of the example fails it."""
    pool = json.loads(json.dumps(_objects()[("InferencePool", "tailserve")]))
    change(pool)
    crd = _crds()[(pool["apiVersion"], "InferencePool")]
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        _check_against_crd(pool, crd)


def test_the_checker_applies_defaults_before_the_routes_rules() -> None:
    """A backendRef with only a name defaults to a core Service, which the HTTPRoute CRD's CEL rule
    requires a port for: the example names the pool's group and kind, so it needs none."""
    route = json.loads(json.dumps(_objects()[("HTTPRoute", "tailserve")]))
    route["spec"]["rules"][0]["backendRefs"] = [{"name": "tailserve"}]
    crd = _crds()[(route["apiVersion"], "HTTPRoute")]
    with pytest.raises(AssertionError, match="Must have port for Service reference"):
        _check_against_crd(route, crd)


def test_the_pool_selects_the_tailserve_replicas_and_names_its_picker() -> None:
    objects = _objects()
    pool = objects[("InferencePool", "tailserve")]["spec"]
    replicas = {(d["kind"], d["metadata"]["name"]): d for d in _docs(REPO / "deploy/k8s/replicas.yaml")}
    pod = replicas[("StatefulSet", "tailserve-replica")]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["number"] for p in pool["targetPorts"]] == [container["ports"][0]["containerPort"]]
    args = build_parser().parse_args(container["args"])
    assert args.port == pool["targetPorts"][0]["number"] and args.host == "0.0.0.0"
    # The EPP scrapes the pool port's /metrics; tailserve serves it there without the API key.
    epp = objects[("Deployment", "tailserve-epp")]
    assert (
        not pool["selector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    )
    picker = pool["endpointPickerRef"]
    service = objects[("Service", picker["name"])]
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()


def test_the_epp_serves_this_pool_with_its_mounted_config() -> None:
    objects = _objects()
    epp = objects[("Deployment", "tailserve-epp")]["spec"]["template"]["spec"]
    (container,) = epp["containers"]
    args = container["args"]
    flag = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert flag["--pool-name"] == "tailserve" and flag["--pool-group"] == "inference.networking.k8s.io"
    config_path = Path(flag["--config-file"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in epp["volumes"] if v["name"] == mount["name"]]
    config_map = objects[("ConfigMap", volume["configMap"]["name"])]
    config = yaml.safe_load(config_map["data"][config_path.name])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")["parameters"]
    assert (source["scheme"], source["path"]) == ("http", "/metrics")
    # Its ServiceAccount may watch the pool and its pods.
    assert epp["serviceAccountName"] == "tailserve-epp"
    binding = objects[("RoleBinding", "tailserve-epp")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": epp["serviceAccountName"]}]
    rules = objects[("Role", binding["roleRef"]["name"])]["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    assert {ev["name"] for ev in container["env"]} >= {"NAMESPACE"}  # the pool's namespace


def test_the_route_sends_to_the_pool_through_the_gateway() -> None:
    objects = _objects()
    route = objects[("HTTPRoute", "tailserve")]["spec"]
    (parent,) = route["parentRefs"]
    assert ("Gateway", parent["name"]) in objects
    (rule,) = route["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tailserve"}
    ]


def test_kustomization_applies_every_manifest() -> None:
    resources = yaml.safe_load((GATEWAY_DIR / "kustomization.yaml").read_text())["resources"]
    assert sorted(resources) == sorted(
        p.name for p in GATEWAY_DIR.glob("*.yaml") if p.name != "kustomization.yaml"
    )
