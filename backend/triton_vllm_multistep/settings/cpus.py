"""CPU lists as config.pbtxt `engine_cpus` and Linux write them ("0-3,6"), and the CPUs this process
may run on.

Owns parsing and writing them; must not move any thread (engine/cpu_placement.py does).
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class CpuListError(ValueError):
    """A CPU list that does not parse, or that this host cannot honour."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,6") as sorted distinct CPU numbers."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise CpuListError(f'{text!r} is not a CPU list such as "1", "2-7" or "0,2-3"') from None
        if first < 0 or last < first:
            raise CpuListError(f"{text!r} is not a CPU list: {part!r} is not a range of CPU numbers")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def cpu_list_text(cpus: Iterable[int]) -> str:
    """CPU numbers as a Linux CPU list, ranges joined ("0-3,6")."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process's calling thread may run on now."""
    return tuple(sorted(os.sched_getaffinity(0)))
