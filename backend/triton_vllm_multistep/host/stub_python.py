"""Which Python a Triton Python-backend stub embeds, read from its ELF dynamic section.

The stub (`triton_python_backend_stub`) is linked against one `libpython3.X.so`; it can only run
packages built for that Python. Owns reading an ELF file's DT_NEEDED entries without running
`ldd` (which may execute the file) or needing binutils; must not decide anything (the launcher does).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

_SHT_DYNAMIC = 6
_DT_NULL = 0
_DT_NEEDED = 1
# libpython3.10.so.1.0, libpython3.8d.so, and auditwheel's renamed libpython3-419a3a08.13.so.1.0
_LIBPYTHON = re.compile(r"libpython(\d+)(?:-[0-9a-f]+)?\.(\d+)[a-z]*\.so(?:\.[\d.]+)?")


class NotAnElf(ValueError):
    """The file is not an ELF shared object or executable this reader understands."""


def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED names of an ELF file (its direct shared-library dependencies), in order."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 52:
        raise NotAnElf(f"{path} is not an ELF file")
    elf_class, encoding = data[4], data[5]
    if elf_class not in (1, 2) or encoding not in (1, 2):
        raise NotAnElf(f"{path}: unknown ELF class {elf_class} or data encoding {encoding}")
    order = "<" if encoding == 1 else ">"
    is64 = elf_class == 2
    try:
        if is64:
            (section_offset,) = struct.unpack_from(order + "Q", data, 0x28)
            entry_size, count = struct.unpack_from(order + "HH", data, 0x3A)
        else:
            (section_offset,) = struct.unpack_from(order + "I", data, 0x20)
            entry_size, count = struct.unpack_from(order + "HH", data, 0x2E)
        # (type, offset, size, link) of every section header
        header = order + ("IIQQQQIIQQ" if is64 else "IIIIIIIIII")
        sections = []
        for index in range(count):
            fields = struct.unpack_from(header, data, section_offset + index * entry_size)
            sections.append((fields[1], fields[4], fields[5], fields[6]))
        needed: list[str] = []
        for kind, offset, size, link in sections:
            if kind != _SHT_DYNAMIC:
                continue
            strings_offset = sections[link][1]
            entry = order + ("qQ" if is64 else "iI")
            step = struct.calcsize(entry)
            for position in range(offset, offset + size - step + 1, step):
                tag, value = struct.unpack_from(entry, data, position)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    start = strings_offset + value
                    needed.append(data[start : data.index(b"\0", start)].decode())
        return needed
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as error:
        raise NotAnElf(f"{path}: malformed ELF file ({error})") from error


def embedded_python(stub: Path) -> str | None:
    """ "3.X" of the libpython the stub links, or None if it links none (e.g. a static build)."""
    for name in needed_libraries(stub):
        match = _LIBPYTHON.fullmatch(name)
        if match:
            return f"{match.group(1)}.{match.group(2)}"
    return None
