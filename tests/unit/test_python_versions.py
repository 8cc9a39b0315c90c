"""The package runs on Python 3.10 (NVIDIA's Triton 24.10 image): no 3.11-only syntax or standard library in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "backend" / "triton_vllm_multistep"
MODULES = sorted(PACKAGE.rglob("*.py"))
# module → names new in 3.11 (or a whole module new in 3.11: None)
NEW_IN_311: dict[str, set[str] | None] = {
    "tomllib": None,
    "wsgiref.types": None,
    "typing": {
        "Self",
        "LiteralString",
        "Never",
        "assert_never",
        "assert_type",
        "reveal_type",
        "TypeVarTuple",
        "Unpack",
        "Required",
        "NotRequired",
        "dataclass_transform",
        "get_overloads",
        "clear_overloads",
    },
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum"},
    "datetime": {"UTC"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier"},
    "contextlib": {"chdir"},
    "operator": {"call"},
    "hashlib": {"file_digest"},
    "logging": {"getLevelNamesMapping"},
}
BUILTINS_NEW_IN_311 = {"ExceptionGroup", "BaseExceptionGroup"}


def test_requires_python_and_ruff_target_include_310() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^requires-python = ">=3\.10,', text, re.M)
    assert re.search(r'^target-version = "py310"', text, re.M)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_uses_nothing_newer_than_310(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path), feature_version=(3, 10))  # rejects except* and other 3.11 syntax
    modules = {}  # local name → module, for `import asyncio` / `import datetime as dt`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEW_IN_311 and NEW_IN_311[alias.name] is None:
                    found.append(alias.name)
                modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in NEW_IN_311:
            new = NEW_IN_311[node.module]
            found += [f"{node.module}.{a.name}" for a in node.names if new is None or a.name in new]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = modules.get(node.value.id)
            if module in NEW_IN_311 and node.attr in (NEW_IN_311[module] or ()):
                found.append(f"{module}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in BUILTINS_NEW_IN_311:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr == "add_note":
            found.append("BaseException.add_note")
    assert not found, f"{path.name} uses Python 3.11 features: {found}"


def test_the_check_sees_a_311_feature(tmp_path: Path) -> None:
    module = tmp_path / "new.py"
    module.write_text(
        "import asyncio\nfrom typing import Self\nasync def f():\n    async with asyncio.TaskGroup():\n        pass\n"
    )
    with pytest.raises(AssertionError, match=r"typing.Self.*asyncio.TaskGroup|asyncio.TaskGroup.*typing.Self"):
        test_module_uses_nothing_newer_than_310(module)
    module.write_text("try:\n    pass\nexcept* ValueError:\n    pass\n")
    with pytest.raises(SyntaxError):
        test_module_uses_nothing_newer_than_310(module)
