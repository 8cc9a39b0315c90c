"""The GPU Dockerfile cannot be built here (no Docker engine, no GPU); lint it and check its wiring."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "docker" / "Dockerfile"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(__file__).resolve().parents[2] / ".venv/bin/hadolint")
    completed = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_dockerfile_installs_the_backend_where_triton_looks() -> None:
    text = DOCKERFILE.read_text()
    assert "vllm==${VLLM_VERSION}" in text and "ARG VLLM_VERSION=0.8.5.post1" in text
    assert "/opt/tritonserver/backends/vllm_multistep/model.py" in text
    assert "numpy==1.26.4" in text
