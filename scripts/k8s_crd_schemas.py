"""Developer tool, outside CI: copy the published CRD schemas that deploy/k8s/inference-gateway is
checked against into tests/deploy/crd_schemas/, from local git clones of the two upstream repositories.

`.venv/bin/python scripts/k8s_crd_schemas.py INFERENCE_EXTENSION_GIT GATEWAY_API_GIT` reads each CRD at
the pinned tag (`git show TAG:PATH`), keeps the openAPIV3Schema of its storage version with the
`description` texts dropped (they are most of the bytes, and no check reads them), and writes one JSON
file per CRD naming the repository, tag, commit, path and the sha256 of the CRD file it came from.
It also checks that every plugin type in the EPP config of deploy/k8s/inference-gateway/epp.yaml is
registered in the EPP source at the pinned tag, and says which one is not (exit 1).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "deploy" / "crd_schemas"
INFERENCE_EXTENSION = ("kubernetes-sigs/gateway-api-inference-extension", "v1.5.0")
GATEWAY_API = ("kubernetes-sigs/gateway-api", "v1.5.1")
CRDS = {
    INFERENCE_EXTENSION: ["config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"],
    GATEWAY_API: [
        "config/crd/standard/gateway.networking.k8s.io_gateways.yaml",
        "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
    ],
}


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "-C", git_dir, *args], check=True, capture_output=True, text=True).stdout


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def copy_schemas(git_dirs: dict[tuple[str, str], str]) -> None:
    """One JSON file per CRD: its source, and the schema of each served version."""
    OUT.mkdir(parents=True, exist_ok=True)
    for (repo, tag), paths in CRDS.items():
        git_dir = git_dirs[(repo, tag)]
        commit = _git(git_dir, "rev-parse", f"{tag}^{{commit}}").strip()
        for path in paths:
            text = _git(git_dir, "show", f"{tag}:{path}")
            crd = yaml.safe_load(text)
            (stored,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
            doc = {
                "source": {
                    "repository": repo,
                    "tag": tag,
                    "commit": commit,
                    "path": path,
                    "sha256": hashlib.sha256(text.encode()).hexdigest(),
                },
                "group": crd["spec"]["group"],
                "kind": crd["spec"]["names"]["kind"],
                "version": stored["name"],
                "schema": _without_descriptions(stored["schema"]["openAPIV3Schema"]),
            }
            name = f"{crd['spec']['group']}_{crd['spec']['names']['plural']}.json"
            (OUT / name).write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
            print(f"{name}: {repo}@{tag} ({commit[:12]}) {path}, storage version {stored['name']}")


def check_plugin_types(git_dir: str) -> int:
    """Every plugin `type` of the EPP config in epp.yaml must be a registered type at the pinned tag."""
    tag = INFERENCE_EXTENSION[1]
    source = _git(git_dir, "grep", "-h", "-E", r'Type\s*=\s*"[a-z0-9-]+"', tag, "--", "pkg/epp")
    registered = set(re.findall(r'Type\s*=\s*"([a-z0-9-]+)"', source))
    docs = yaml.safe_load_all((REPO / "deploy/k8s/inference-gateway/epp.yaml").read_text())
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["default-plugins.yaml"])
    wanted = [p["type"] for p in config["plugins"]]
    missing = [t for t in wanted if t not in registered]
    print(
        f"EPP plugin types at {tag}: {len(wanted) - len(missing)} of {len(wanted)} registered", missing or ""
    )
    return 1 if missing else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    inference_extension, gateway_api = argv
    copy_schemas({INFERENCE_EXTENSION: inference_extension, GATEWAY_API: gateway_api})
    return check_plugin_types(inference_extension)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
