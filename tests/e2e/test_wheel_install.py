"""A wheel of this project, installed into a fresh venv, serves the LLM through `triton-vllm-multistep serve`.

Proves a regular (non-editable) install has everything the launcher and the stub need (the entry
point stub/model.py included), and that the launcher gives the stub that install, not the source
tree. The fresh venv gets the heavy dependencies (vLLM, torch, tritonclient, the Triton binaries)
without reinstalling them: a `.pth` file naming this venv's site-packages. Not
`--system-site-packages`: that exposes the base interpreter's packages, not this venv's; and a
`.pth` line adds that one folder without running its own .pth files, so this venv's editable
install (a path to the source tree) stays out. Builds offline: setuptools' PEP 517 hook, pip from
ensurepip's bundled wheel with --no-index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from private_servers import REPO_ROOT, SHIPPED_MODEL
from triton_clients import grpc_generate

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.testing.local_server import ServerProcess, copy_model, free_ports

pytestmark = pytest.mark.slow
PACKAGE = "triton_vllm_multistep"


def build_wheel(out: Path) -> Path:
    """The wheel, built from a copy of what docker/Dockerfile copies (a build writes into its source)."""
    source = out / "source"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    shutil.copytree(
        REPO_ROOT / "backend", source / "backend", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    wheels = out / "wheels"
    subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(wheels)!r})"],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("triton_vllm_multistep-*.whl")
    return wheel


def fresh_venv(root: Path, wheel: Path) -> tuple[Path, Path]:
    """(its python, its site-packages): the wheel installed with --no-deps, this venv's packages via a .pth."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "heavy_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", str(wheel)],
        check=True,
        capture_output=True,
        env=clean_environment(),
    )
    return python, site


def clean_environment() -> dict[str, str]:
    """This process's environment without anything pointing Python at the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def test_wheel_in_a_fresh_venv_serves_the_llm(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "build")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for module in ("stub/model.py", "host/cli.py", "host/launcher.py", "host/stub_python.py", "demo/models.py"):
        assert f"{PACKAGE}/{module}" in names, module
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "backend/"))]

    python, site = fresh_venv(tmp_path / "venv", wheel)
    command = python.parent / "triton-vllm-multistep"
    assert command.exists()
    assert (site / PACKAGE / "stub" / "model.py").read_bytes() == (
        REPO_ROOT / "backend" / PACKAGE / "stub" / "model.py"
    ).read_bytes()
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = clean_environment()
    # vLLM logs to stdout: the answers are the lines with a prefix of their own.
    script = (
        f"import sys, {PACKAGE} as p, vllm; print('file:', p.__file__); "
        "print(*('path: ' + e for e in sys.path), sep='\\n')"
    )
    lines = subprocess.run(
        [str(python), "-c", script], cwd=workdir, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert f"file: {site / PACKAGE / '__init__.py'}" in lines, lines
    source_tree = str(REPO_ROOT / "backend")
    assert f"path: {source_tree}" not in lines, "the source tree is on the fresh venv's sys.path"

    # A cache of the test's own (the launcher lays out its backend folder there), sharing the built demo models.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "demo-models").symlink_to(demo_models.cache_home() / "demo-models", target_is_directory=True)
    for name in demo_models.DEMO_MODELS:
        demo_models.build(name)
    repository = tmp_path / "repository"
    repository.mkdir()
    tiny = {"model": "demo://tiny-llama-bpe", "max_model_len": 256}
    copy_model(SHIPPED_MODEL, repository / "vllm_model", engine=tiny)
    http_port, grpc_port, metrics_port = free_ports(3)
    env.update(TRITON_VLLM_MULTISTEP_CACHE=str(cache), VLLM_CPU_KVCACHE_SPACE="1")
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                str(command),
                "serve",
                f"--model-repository={repository}",
                f"--http-port={http_port}",
                f"--grpc-port={grpc_port}",
                f"--metrics-port={metrics_port}",
            ],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = ServerProcess(process, http_port, grpc_port, metrics_port, log_path)
    try:
        server.wait_ready(timeout=300)
        installed_backend = cache / "backends" / "vllm_multistep"
        assert (installed_backend / "vllm_multistep" / "model.py").exists()
        (stub,) = server.process_groups()["stub"]
        stub_path = stub.environ()["PYTHONPATH"].split(os.pathsep)
        assert Path(stub_path[0]).resolve() == site.resolve(), stub_path  # the installed package first
        assert source_tree not in stub_path and str(REPO_ROOT) not in stub_path, stub_path
        result = grpc_generate(
            server.grpc_url,
            "vllm_model",
            prompt="The wheel says",
            sampling={"max_tokens": 6, "temperature": 0, "ignore_eos": True},
            stream=True,
            return_num_output_tokens=True,
        )
        assert result.error is None and result.finals == 1, result
        assert sum(int(r["num_output_tokens"].sum()) for r in result.responses) == 6
        assert sum(len(r["output_ids"]) for r in result.responses) == 6
    finally:
        code = server.stop(timeout=120)
    assert code == 0, server.log_tail()
