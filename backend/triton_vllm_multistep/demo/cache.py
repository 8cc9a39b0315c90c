"""Where built demo models live and how a build is published: the demo builders' shared leaf.

Owns the cache folder (TRITON_VLLM_MULTISTEP_CACHE), the build version, the error of a model that
cannot be provided, the atomic publish of a
built folder and a folder's content digest; imports nothing of the package, so every builder can
use it without importing another.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class DemoModelError(ValueError):
    """A demo model that comes from a PyPI package cannot be provided; the message says what to run."""


# Bump when the builder's output changes, so stale caches are rebuilt rather than reused.
BUILD_VERSION = "v1"


def cache_home() -> Path:
    """This project's cache folder; TRITON_VLLM_MULTISTEP_CACHE overrides the default."""
    base = os.environ.get("TRITON_VLLM_MULTISTEP_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "triton-vllm-multistep"


def cache_root() -> Path:
    """Folder holding built demo models."""
    return cache_home() / "demo-models" / BUILD_VERSION


def publish(target: Path, write: Callable[[Path], None]) -> Path:
    """Build a model folder with `write(staging)` beside `target`, then rename it into place.

    Atomic publish: concurrent builders of the same deterministic content cannot clash (a builder
    that finds the folder already published by another keeps that one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def folder_digest(folder: Path) -> str:
    """SHA-256 over every file's name and bytes, to check that two builds are identical."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
