"""The launcher's choice of Python backend stub (by the libpython it links), install-backend, the stub's PYTHONPATH."""

from __future__ import annotations

import importlib.util
import struct
import sys
import sysconfig
from pathlib import Path

import pytest

from triton_vllm_multistep.host import cli, launcher, stub_python

THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def minimal_elf(needed: list[str], is64: bool = True, little: bool = True) -> bytes:
    """An ELF file with just what DT_NEEDED reading uses: section headers, .dynstr and .dynamic."""
    order = "<" if little else ">"
    strings = b"\0" + b"".join(name.encode() + b"\0" for name in needed)
    name_offsets = []
    position = 1
    for name in needed:
        name_offsets.append(position)
        position += len(name) + 1
    entry = order + ("qQ" if is64 else "iI")
    dynamic = b"".join(struct.pack(entry, 1, offset) for offset in name_offsets) + struct.pack(entry, 0, 0)
    header_size, section_size = (64, 64) if is64 else (52, 40)
    strings_at = header_size
    dynamic_at = strings_at + len(strings)
    sections_at = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes([2 if is64 else 1, 1 if little else 2, 1]) + bytes(9)
    if is64:
        header = ident + struct.pack(order + "HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sections_at, 0, 64, 0, 0, 64, 3, 0)
        section = order + "IIQQQQIIQQ"
    else:
        header = ident + struct.pack(order + "HHIIIIIHHHHHH", 3, 3, 1, 0, 0, sections_at, 0, 52, 0, 0, 40, 3, 0)
        section = order + "IIIIIIIIII"
    sections = (
        struct.pack(section, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        + struct.pack(section, 0, 3, 0, 0, strings_at, len(strings), 0, 0, 1, 0)  # SHT_STRTAB
        + struct.pack(section, 0, 6, 0, 0, dynamic_at, len(dynamic), 1, 0, 8, struct.calcsize(entry))  # SHT_DYNAMIC
    )
    assert len(header) == header_size and len(sections) == 3 * section_size
    return header + strings + dynamic + sections


def fake_system_triton(root: Path, stubs: dict[str, list[str]]) -> Path:
    """/opt/tritonserver-like tree; `stubs` maps a path under backends/python to its DT_NEEDED."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").write_bytes(minimal_elf(["libtritonserver.so"]))
    python_backend = root / "backends" / "python"
    python_backend.mkdir(parents=True)
    (python_backend / "libtriton_python.so").write_bytes(b"")
    for relative, needed in stubs.items():
        (python_backend / relative).parent.mkdir(parents=True, exist_ok=True)
        (python_backend / relative).write_bytes(minimal_elf(needed))
    return root


@pytest.mark.parametrize(("is64", "little"), [(True, True), (False, True), (True, False), (False, False)])
def test_needed_libraries_of_a_minimal_elf(tmp_path: Path, is64: bool, little: bool) -> None:
    path = tmp_path / "stub"
    path.write_bytes(minimal_elf(["libcudart.so.12", "libpython3.10.so.1.0", "libc.so.6"], is64, little))
    assert stub_python.needed_libraries(path) == ["libcudart.so.12", "libpython3.10.so.1.0", "libc.so.6"]
    assert stub_python.embedded_python(path) == "3.10"


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("libpython3.10.so.1.0", "3.10"),
        ("libpython3.12.so", "3.12"),
        ("libpython3.8d.so.1.0", "3.8"),
        ("libpython3-419a3a08.13.so.1.0", "3.13"),  # auditwheel's rename in nvidia-pytriton
        ("libpythonish.so", None),
    ],
)
def test_embedded_python_reads_the_libpython_name(tmp_path: Path, name: str, version: str | None) -> None:
    path = tmp_path / "stub"
    path.write_bytes(minimal_elf(["libc.so.6", name]))
    assert stub_python.embedded_python(path) == version


def test_real_pytriton_stubs_embed_the_python_of_their_folder() -> None:
    spec = importlib.util.find_spec("pytriton")
    assert spec is not None and spec.submodule_search_locations, "nvidia-pytriton is part of the dev set"
    stubs = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "python_backend_stubs"
    versions = sorted(p.name for p in stubs.iterdir() if (p / "triton_python_backend_stub").exists())
    assert THIS_PYTHON in versions
    for version in versions:
        assert stub_python.embedded_python(stubs / version / "triton_python_backend_stub") == version


def test_not_an_elf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "stub"
    path.write_text("#!/bin/sh\n")
    with pytest.raises(stub_python.NotAnElf):
        stub_python.needed_libraries(path)
    path.write_bytes(minimal_elf(["libpython3.10.so"])[:70])  # cut off: section headers missing
    with pytest.raises(stub_python.NotAnElf):
        stub_python.needed_libraries(path)


def test_system_triton_stub_of_the_same_python_is_used(tmp_path: Path) -> None:
    root = fake_system_triton(tmp_path / "tritonserver", {"triton_python_backend_stub": ["libpython3.10.so.1.0"]})
    install = launcher.find_triton(root, python_version="3.10")
    assert install.server == root / "bin" / "tritonserver"
    assert install.stub == root / "backends" / "python" / "triton_python_backend_stub"


def test_system_triton_stub_of_another_python_fails_saying_what_to_do(tmp_path: Path) -> None:
    root = fake_system_triton(tmp_path / "tritonserver", {"triton_python_backend_stub": ["libpython3.10.so.1.0"]})
    with pytest.raises(launcher.LaunchError) as raised:
        launcher.find_triton(root, python_version="3.11")
    message = str(raised.value)
    assert "embeds Python 3.10" in message and "Python 3.11" in message
    assert str(root / "backends" / "python" / "python_backend_stubs" / "3.11" / "triton_python_backend_stub") in message


def test_system_triton_stub_built_per_version_is_used_when_the_default_does_not_match(tmp_path: Path) -> None:
    root = fake_system_triton(
        tmp_path / "tritonserver",
        {
            "triton_python_backend_stub": ["libpython3.10.so.1.0"],
            "python_backend_stubs/3.11/triton_python_backend_stub": ["libpython3.11.so.1.0"],
            "python_backend_stubs/3.12/triton_python_backend_stub": ["libpython3.12.so.1.0"],
        },
    )
    stubs = root / "backends" / "python" / "python_backend_stubs"
    assert launcher.find_triton(root, python_version="3.11").stub == stubs / "3.11" / "triton_python_backend_stub"
    assert launcher.find_triton(root, python_version="3.12").stub == stubs / "3.12" / "triton_python_backend_stub"


def test_a_per_version_stub_in_the_wrong_folder_is_not_trusted(tmp_path: Path) -> None:
    root = fake_system_triton(
        tmp_path / "tritonserver",
        {
            "triton_python_backend_stub": ["libpython3.10.so.1.0"],
            "python_backend_stubs/3.11/triton_python_backend_stub": ["libpython3.12.so.1.0"],
        },
    )
    with pytest.raises(launcher.LaunchError, match="embeds Python 3.12"):
        launcher.find_triton(root, python_version="3.11")


def test_system_triton_stub_that_is_not_an_elf_is_a_clear_error(tmp_path: Path) -> None:
    root = fake_system_triton(tmp_path / "tritonserver", {})
    (root / "backends" / "python" / "triton_python_backend_stub").write_text("not a binary")
    with pytest.raises(launcher.LaunchError, match="cannot read the Python backend stub"):
        launcher.find_triton(root, python_version="3.10")


def test_without_system_triton_the_pytriton_stub_of_this_python_is_used(tmp_path: Path) -> None:
    install = launcher.find_triton(tmp_path / "absent")
    assert install.stub.parent.name == THIS_PYTHON
    assert stub_python.embedded_python(install.stub) == THIS_PYTHON


def test_install_backend_puts_the_entry_point_where_triton_looks(tmp_path: Path, capsys) -> None:
    root = fake_system_triton(tmp_path / "tritonserver", {"triton_python_backend_stub": [f"libpython{THIS_PYTHON}.so"]})
    backends = root / "backends"
    assert cli.main(["install-backend", "--backends-dir", str(backends)]) == 0
    installed = backends / launcher.BACKEND_NAME / "model.py"
    assert installed.read_bytes() == launcher.BACKEND_MODEL_PY.read_bytes()
    assert "class TritonPythonModel" in installed.read_text()
    assert capsys.readouterr().err == ""  # the stub embeds this Python: no warning


def test_install_backend_warns_when_the_stub_cannot_import_this_environment(tmp_path: Path, capsys) -> None:
    root = fake_system_triton(tmp_path / "tritonserver", {"triton_python_backend_stub": ["libpython2.7.so.1.0"]})
    assert cli.main(["install-backend", "--backends-dir", str(root / "backends")]) == 0
    assert "warning:" in capsys.readouterr().err and (root / "backends" / "vllm_multistep" / "model.py").exists()


def test_install_backend_refuses_a_folder_without_the_python_backend(tmp_path: Path, capsys) -> None:
    assert cli.main(["install-backend", "--backends-dir", str(tmp_path)]) == 2
    assert "no python/ folder" in capsys.readouterr().err
    assert not (tmp_path / launcher.BACKEND_NAME).exists()


def test_stub_pythonpath_has_this_package_first_then_this_interpreters_packages_not_its_stdlib() -> None:
    install = launcher.find_triton(Path("/nonexistent"))
    entries = launcher.server_environment(install, base={})["PYTHONPATH"].split(":")
    assert entries[0] == str(launcher.PACKAGE_PARENT)
    assert sysconfig.get_paths()["purelib"] in entries
    stdlib = sysconfig.get_paths()["stdlib"]
    assert not [e for e in entries if e == stdlib or e.startswith(stdlib + "/lib-dynload")]
    assert "" not in entries
