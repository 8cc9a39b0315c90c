"""Where the V1 environment's processes get their Python and their environment.

Owns the V1 environment's interpreter (config.pbtxt `vllm_engine: v1`: TRITON_VLLM_MULTISTEP_V1_PYTHON,
which the launcher and the image set, else the .venv-v1 scripts/setup.sh builds beside this
environment) and the environment a process under it gets (this package alone of our import paths):
one fact for the V1 engine process (engine/process.py) and a V1 model's OpenAI server (frontend/).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

V1_PYTHON_ENV = "TRITON_VLLM_MULTISTEP_V1_PYTHON"
# The folder holding this package: all a V1 process is given of this environment's import paths.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def v1_environment_python() -> Path | None:
    """The Python of the V1 environment scripts/setup.sh builds beside this one (.venv-v1), if there is one."""
    candidate = Path(sys.prefix).parent / ".venv-v1" / "bin" / "python"
    return candidate if candidate.exists() else None


def configured_v1_python() -> str | None:
    """The V1 environment's Python a process of this package starts V1 processes with: V1_PYTHON_ENV
    (the launcher and the image set it), else the .venv-v1 beside this environment, else None."""
    return os.environ.get(V1_PYTHON_ENV) or (str(local) if (local := v1_environment_python()) else None)


def no_v1_environment(who: str) -> str:
    """Why `who` cannot start a V1 process here: no V1 environment's Python configured or beside this one."""
    return (
        f"{who} needs the V1 environment's Python: {V1_PYTHON_ENV} is not set (the launcher and the image set it) "
        "and there is no .venv-v1 beside this environment (scripts/setup.sh builds it)"
    )


def v1_import_path(package_parent: str) -> dict[str, str]:
    """The V1 engine process's PYTHONPATH: the package's folder when it is a source checkout (scripts/
    setup.sh's .venv-v1 has no copy), nothing when it is installed (a site-packages folder would
    bring this environment's vLLM, torch and numpy ahead of the V1 environment's: the image installs
    the package into its V1 environment too, docker/Dockerfile)."""
    if os.path.basename(package_parent) in ("site-packages", "dist-packages"):
        return {}
    return {"PYTHONPATH": package_parent}


def v1_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process under the V1 environment's Python (a V1 engine process, a V1 model's
    OpenAI server), from this process's: this package alone of its import paths, no V0 pin."""
    environment = dict(base)
    environment.pop("PYTHONPATH", None)
    environment.update(v1_import_path(PACKAGE_PARENT))
    environment.pop("VLLM_USE_V1", None)  # the stub's environment pins V0 for its own vLLM
    return environment
