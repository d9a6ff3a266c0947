"""deploy/k8s manifests: probes, scrape annotations, container args the CLI actually accepts, and the
dcgm-exporter DaemonSet with the counters file and exporter version deploy/dcgm documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import build_parser
from tests.deploy.contract import DCGM_COUNTERS, dcgm_exporter_image

yaml = pytest.importorskip("yaml")
K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "metadata" in doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_workloads_have_probes_annotations_and_valid_args() -> None:
    objects = _objects()
    workloads = [o for (kind, _), o in objects.items() if kind in ("Deployment", "StatefulSet")]
    assert len(workloads) == 2
    parser = build_parser()
    for workload in workloads:
        pod = workload["spec"]["template"]
        annotations = pod["metadata"]["annotations"]
        (container,) = pod["spec"]["containers"]
        port = container["ports"][0]["containerPort"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        args = parser.parse_args(container["args"])
        assert args.port == port and args.host == "0.0.0.0"


def test_router_lists_every_replica_by_its_stable_name() -> None:
    objects = _objects()
    replicas = objects[("StatefulSet", "tailserve-replica")]
    service = objects[("Service", replicas["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    router = objects[("Deployment", "tailserve-router")]
    args = build_parser().parse_args(router["spec"]["template"]["spec"]["containers"][0]["args"])
    port = service["spec"]["ports"][0]["port"]
    expected = [
        f"http://tailserve-replica-{i}.{service['metadata']['name']}:{port}"
        for i in range(replicas["spec"]["replicas"])
    ]
    assert args.replica == expected


def test_kustomization_applies_every_manifest() -> None:
    resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(resources) == sorted(manifests)


def _flags(args: list[str]) -> dict[str, str]:
    """`--name=value` / `--name` (a boolean) as the exporter's CLI reads them."""
    flags = {}
    for arg in args:
        assert arg.startswith("--"), arg
        name, _, value = arg.removeprefix("--").partition("=")
        flags[name] = value or "true"
    return flags


def test_dcgm_exporter_runs_on_gpu_nodes_with_the_documented_counters_and_is_scraped() -> None:
    objects = _objects()
    daemonset = objects[("DaemonSet", "dcgm-exporter")]
    pod = daemonset["spec"]["template"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])  # GPU nodes are often tainted
    (container,) = spec["containers"]
    assert container["image"] == dcgm_exporter_image()  # the version fields.txt lists the names of
    flags = _flags(container["args"])
    port = container["ports"][0]
    # Scraped the way the replicas are, on the port the exporter listens on.
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert flags["address"] == f":{port['containerPort']}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    # The counters file is the documented one, mounted where --collectors points.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    directory, _, filename = flags["collectors"].rpartition("/")
    config_map = objects[("ConfigMap", volumes[mounts[directory]["name"]]["configMap"]["name"])]
    assert config_map["data"][filename] == DCGM_COUNTERS.read_text()
    # Profiling fields need SYS_ADMIN; GPU-to-pod labels need --kubernetes and the kubelet's pod resources.
    assert "SYS_ADMIN" in container["securityContext"]["capabilities"]["add"]
    assert flags["kubernetes"] == "true"
    resources = mounts["/var/lib/kubelet/pod-resources"]
    assert volumes[resources["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert int(flags["collect-interval"]) <= 5000  # ms: no coarser than the 5 s scrape interval


def test_rayservice_runs_build_app_with_args_it_accepts_on_the_pinned_ray() -> None:
    """deploy/k8s/ray: the serve config's app is build_app, its args are `tailserve serve` flags and
    build_app's Ray keys that parse, and KubeRay's rayVersion is the Ray pyproject pins (the
    RequestRouter API is alpha)."""
    ray_serve = pytest.importorskip("tailserve.integrations.ray_serve")
    (service,) = yaml.safe_load_all((K8S / "ray" / "rayservice.yaml").read_text())
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "tailserve.integrations.ray_serve:build_app"
    args = app["args"]
    flags = {k: v for k, v in args.items() if k not in ray_serve.DEPLOYMENT_KEYS}
    engine, _ = ray_serve.serve_configs(flags)
    options = ray_serve.deployment_options(args, engine)
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = sum(
        int(g["replicas"])
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in workers
    )
    assert options["num_replicas"] * options["ray_actor_options"]["num_gpus"] == gpus
    pyproject = (K8S.parents[1] / "pyproject.toml").read_text()
    ray_version = service["spec"]["rayClusterConfig"]["rayVersion"]
    assert f'"ray[serve]=={ray_version}"' in pyproject
