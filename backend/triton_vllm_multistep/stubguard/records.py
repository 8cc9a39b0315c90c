"""What the stub guards leave for the launcher (stall records) and the launcher for the next server
(how many times it restarted one that crashed).

Owns the record file's format, writing and reading it, and naming the cause of a crash from it;
must not decide anything about the server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

# A JSON-lines file the guards append to (the launcher sets it for the server it starts).
RECORDS_ENV = "TRITON_VLLM_MULTISTEP_STALL_RECORDS"
# How many times `serve --restart-on-crash` restarted the server before this one.
SERVER_RESTARTS_ENV = "TRITON_VLLM_MULTISTEP_SERVER_RESTARTS"
RESTARTS_METRIC = "vllm_multistep:server_restarts_total"
LOST = "lost"  # the guard took the server down: Triton gave up on its stub
# Records this recent are worth naming when the server dies without a "lost" record.
RECENT_SECONDS = 30.0


@dataclass(frozen=True)
class Record:
    time: float
    kind: str  # contained | guard_gap | died | lost
    instance: str
    message: str


def append(path: Path, record: dict[str, object]) -> None:
    """One line per record; small appends to one file do not interleave."""
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def read(path: Path) -> list[Record]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            raw = json.loads(line)
            found.append(Record(float(raw["time"]), str(raw["kind"]), str(raw["instance"]), str(raw["message"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    return found


def crash_cause(records: list[Record], now: float | None = None) -> str | None:
    """What the records say about why the server died: the stubs lost, else the recent stalls and deaths."""
    lost = [r for r in records if r.kind == LOST]
    if lost:
        return "; ".join(r.message for r in lost)
    now = time.time() if now is None else now
    recent = [r for r in records if r.kind != "contained" and now - r.time <= RECENT_SECONDS]
    return "; ".join(r.message for r in recent) or None
