"""deploy/k8s manifests: probes, scrape annotations, and container args the CLI actually accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tailserve.cli import build_parser

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
