"""Start-up cost of where the engine runs: start to READY and idle memory, engine process vs in the stub.

`.venv/bin/python -m benchmarks.startup_bench [--rounds N] [--model REF]` starts the shipped model
(steps 8, per step) through the launcher with `engine_process` true and false in turn, N rounds,
one server at a time, and prints each start's seconds to READY and the idle RSS (PSS) of
tritonserver, its stubs and engine processes 3 s after READY. Asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

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
                finally:
                    server.stop()
                print(
                    f"round {round_index}, {label}: READY after {ready:.1f} s, idle RSS {memory['rss_gb']:.2f} GB "
                    f"(PSS {memory['pss_gb']:.2f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
