"""Start-up cost of where the engine runs: start to READY and idle memory, engine process vs in the stub.

`.venv/bin/python -m benchmarks.startup_bench [--rounds N] [--model REF]` starts the shipped model
(steps 8, per step) through the launcher with `engine_process` true and false in turn, N rounds,
one server at a time, and prints each start's seconds to READY and the idle RSS (PSS) of
tritonserver, its stubs and engine processes 3 s after READY, then each kind's resident memory and
the CPU-seconds it spent by then (its start and the model's load). Asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.served import servers
from benchmarks.served.settings import DEFAULT_MODEL_REFERENCE

PLACEMENTS = {"engine process": {"engine_process": "true"}, "engine in the stub": {"engine_process": "false"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=DEFAULT_MODEL_REFERENCE)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        for round_index in range(options.rounds):
            for label, parameters in PLACEMENTS.items():
                target = Path(tmp) / f"{round_index}-{parameters['engine_process']}"
                repository = servers.make_repository(target, 8, "step", options.model, {}, parameters)
                server, ready = servers.start_server(repository, target.with_suffix(".log"))
                try:
                    time.sleep(3.0)  # start-up allocations settle, as in the served benchmark
                    memory = servers.memory_of(server)
                    kinds = _per_kind(server)
                finally:
                    server.stop()
                print(
                    f"round {round_index}, {label}: READY after {ready:.1f} s, idle RSS {memory['rss_gb']:.2f} GB "
                    f"(PSS {memory['pss_gb']:.2f}); {kinds}",
                    flush=True,
                )


def _per_kind(server: Any) -> str:
    """Each kind of process's resident memory and the CPU it spent to get there (its start and load)."""
    parts = []
    for kind, procs in server.process_groups().items():
        rss = cpu = 0.0
        for proc in procs:
            try:
                rss += proc.memory_info().rss / 2**20
                times = proc.cpu_times()
                cpu += times.user + times.system + times.children_user + times.children_system
            except Exception:  # gone meanwhile
                continue
        if procs:
            parts.append(f"{kind} {rss:.0f} MB {cpu:.1f} CPU-s")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
