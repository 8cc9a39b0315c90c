"""The README's quick start as a new user runs it, on fresh clones, with a stall detector in every stub:
what stalls a stub on a fresh machine (docs/lifecycle.md, "What stalls a stub").

Not a pytest module (each run sets up a fresh clone's .venv). Usage:
    .venv/bin/python tests/stress/readme_flow.py --runs 6 [--work-dir DIR] [--cold-cache] [--busy N]

Each run: `git clone` of this checkout, its own `scripts/setup.sh`, (with --cold-cache, as root: the
page cache dropped, as on a machine just started), `scripts/serve.sh` with
TRITON_VLLM_MULTISTEP_STALL_DETECTOR set, the README's two client commands once READY, a third request,
then SIGTERM. Prints per run: the answers, every gap over 250 ms the stubs' detectors recorded (with
the host's pressure, the process's faults and whether the wall clock moved), the stub guards' records
and whether the server survived.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ["What is the capital of France?", "--model", "ensemble", "--chat"],
    ["Give me three tips for staying focused while studying.", "--model", "ensemble", "--chat", "--max-tokens", "160"],
    ["What is the capital of France?", "--model", "ensemble", "--chat"],
]


def busy_loops(count: int) -> list[subprocess.Popen]:
    """`count` CPU-bound processes, each in a session of its own (as other users' jobs would be)."""
    loop = "while True: sum(i * i for i in range(10_000))"
    return [subprocess.Popen([sys.executable, "-c", loop], start_new_session=True) for _ in range(count)]


def run_once(index: int, work: Path, cold_cache: bool, busy: int = 0) -> dict:
    clone = work / f"clone{index}"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    started = time.monotonic()
    subprocess.run(["scripts/setup.sh"], cwd=clone, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    setup_seconds = time.monotonic() - started
    if cold_cache and os.geteuid() == 0:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    detector, records = clone / "stalls-detector.jsonl", clone / "stalls-guard.jsonl"
    env = {
        **os.environ,
        "TRITON_VLLM_MULTISTEP_STALL_DETECTOR": str(detector),
        "TRITON_VLLM_MULTISTEP_STALL_RECORDS": str(records),
    }
    log = (clone / "server.log").open("w")
    server = subprocess.Popen(
        ["scripts/serve.sh"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    answers = []
    loops = busy_loops(busy)
    try:
        deadline = time.monotonic() + 600
        while "Started GRPCInferenceService" not in (clone / "server.log").read_text(errors="replace"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"run {index}: the server did not start")
            time.sleep(1)
        for question in QUESTIONS:
            done = subprocess.run(
                [str(clone / ".venv/bin/python"), "client_examples/grpc_stream.py", *question],
                cwd=clone,
                capture_output=True,
                text=True,
                timeout=600,
            )
            answers.append(
                {"rc": done.returncode, "out": done.stdout.strip()[-120:], "err": done.stderr.strip()[-300:]}
            )
        survived = server.poll() is None
    finally:
        for loop in loops:
            loop.kill()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []  # noqa: E731
    return {
        "run": index,
        "setup_seconds": round(setup_seconds),
        "answers": answers,
        "survived": survived,
        "detector": read(detector),
        "guard": read(records),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/readme-flow"))
    parser.add_argument("--cold-cache", action="store_true")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the server (a busy host)")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    for index in range(args.runs):
        result = run_once(index, args.work_dir, args.cold_cache, args.busy)
        failed = not result["survived"] or any(a["rc"] != 0 for a in result["answers"])
        failures += failed
        print(json.dumps(result), flush=True)
        shutil.rmtree(args.work_dir / f"clone{index}" / ".venv", ignore_errors=True)  # 3.5 GB each
    print(f"{args.runs} runs, {failures} with a failed answer or a lost server", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
