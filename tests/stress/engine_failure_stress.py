"""Stress run of the failure paths through one real tritonserver: engine faults, engine-process
deaths, failing sends, cancels and unloads, many times, under CPU load, with streams in flight on
a model that is never faulted. Prints one line per run and a summary; exits 1 on any abort,
hang or lost stream.

Not a pytest module (it runs for minutes; tests/e2e runs one round of each path). Usage:
    .venv/bin/python tests/stress/engine_failure_stress.py --runs 30 [--cpu-load 2] [--log-dir DIR]

Each run: the victim (alternately with the engine in a process of its own and in the stub) and a
bystander model stream LONG requests; once all have their first token the run's path is taken:
- forward:  the victim's forward pass raises (the engine fails; the model unloads itself);
- exit:     the victim's engine process exits (engine-process victim only);
- send:     the victim's sends raise (its streams are aborted; the engine runs on);
- cancel:   the victim's streams are cancelled by their clients;
- unload:   the victim is unloaded with streams in flight (they drain or end with an error);
- churn:    no fault: short requests arrive back to back for CHURN_SECONDS (new requests while
            others end, the pattern of the paths above at their moment of failure);
- stall:    the victim's stub is stopped (SIGSTOP) for 1.5-5 s, then continued: its stub guard keeps
            Triton waiting, so every stream and arrival completes (docs/lifecycle.md);
- stall_stage: the same for the ensemble's preprocessing or postprocessing stub (alternately), with
            the victim streams and arrivals going through the ensemble.
Throughout every run, short requests keep arriving at the victim (as from a load balancer), so
that new requests meet the failure; each must end once, completed or with an error.
What must hold: every victim stream ends once (one FINAL or a stream error, the injected faults
with an error, never a cut-short stream without one), every bystander stream completes in full,
the server stays alive, and its log shows no abort. The server is restarted after a failed run so
that later runs still count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import tritonclient.grpc as grpcclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from private_servers import copy_pipeline_stages, make_repository, model_ready
from triton_clients import StreamResult, grpc_generate

from triton_vllm_multistep.testing.faults import model_fault_file, server_environment
from triton_vllm_multistep.testing.local_server import ServerProcess, start_ready_server
from triton_vllm_multistep.testing.polling import wait_for

VICTIM_PROCESS = "victim_process"
VICTIM_STUB = "victim_stub"
BYSTANDER = "bystander"
MODELS = {
    VICTIM_PROCESS: {},
    VICTIM_STUB: {"parameters": {"engine_process": "false"}},
    BYSTANDER: {},
    "vllm_model": {},  # the LLM model of the ensemble (stall_stage)
}
LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
BYSTANDER_TOKENS = 120
PATHS = ("forward", "exit", "send", "cancel", "unload", "churn", "stall", "stall_stage")
ENSEMBLE = "ensemble"  # around vllm_model, for stall_stage
STAGES = ("preprocessing", "postprocessing")
SHORT = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
CHURN_SECONDS = 15.0
MALLOC_DEBUG_LIBRARY = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
# Lines of a server log that mean a process of the server aborted or crashed.
ABORT_MARKS = ("Signal (", "malloc", "double free", "corrupted", "Segmentation fault", "core dumped")


@dataclass
class RunResult:
    number: int
    victim: str
    path: str
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


class StreamGroup:
    """`count` streams of one model on threads, each a StreamResult (or the exception it raised)."""

    def __init__(self, server: ServerProcess, model: str, count: int, sampling: dict, cancel_after: int | None = None):
        self.results: dict[int, StreamResult | BaseException] = {}
        self._first = threading.Semaphore(0)
        self._threads = [
            threading.Thread(target=self._run, args=(server, model, i, sampling, cancel_after), daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, server: ServerProcess, model: str, index: int, sampling: dict, cancel_after: int | None) -> None:
        seen = []

        def first() -> None:
            if not seen:
                seen.append(True)
                self._first.release()

        try:
            self.results[index] = grpc_generate(
                server.grpc_url,
                model,
                prompt=f"stress stream {index}",
                sampling=sampling,
                stream=True,
                timeout=90,
                on_response=first,
                cancel_after=cancel_after,
            )
        except BaseException as error:  # a hang is a TimeoutError here
            self.results[index] = error
        finally:
            if not seen:
                self._first.release()

    def wait_first(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(self._first.acquire(timeout=max(0.0, deadline - time.monotonic())) for _ in self._threads)

    def join(self, timeout: float) -> list[StreamResult | BaseException]:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = sum(thread.is_alive() for thread in self._threads)
        return [*self.results.values(), *[TimeoutError("client still waiting")] * hung]


class Arrivals:
    """Short requests sent back to back to one model from `clients` threads until stopped."""

    def __init__(self, server: ServerProcess, model: str, clients: int) -> None:
        self.results: list[StreamResult | BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(server, model), daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self, server: ServerProcess, model: str) -> None:
        while not self._stop.is_set():
            try:
                result: StreamResult | BaseException = grpc_generate(
                    server.grpc_url, model, prompt="arrival", sampling=SHORT, stream=True, timeout=60, settle=0.0
                )
            except BaseException as error:
                result = error
            self.results.append(result)
            if isinstance(result, StreamResult) and result.error is not None:
                time.sleep(0.05)  # refused (model failed or unloading): a client backs off a little

    def stop(self, timeout: float) -> list[str]:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        problems = [f"an arrival client still waits after {timeout:.0f} s" for t in self._threads if t.is_alive()]
        for result in self.results:
            if not isinstance(result, StreamResult):
                problems.append(f"arrival: {type(result).__name__}: {result}")
            elif result.finals != 1:
                problems.append(f"arrival: {result.finals} finals ({result.error})")
            elif result.error is None and len(result.token_ids()) != SHORT["max_tokens"]:
                problems.append(f"arrival: cut short without an error ({len(result.token_ids())} tokens)")
        return problems


def _burn(stop_at: float) -> None:
    while time.time() < stop_at:
        sum(i * i for i in range(10_000))


def victim_problems(results: list, path: str) -> list[str]:
    problems = []
    for index, result in enumerate(results):
        if not isinstance(result, StreamResult):
            problems.append(f"victim stream {index}: {type(result).__name__}: {result}")
            continue
        if path == "cancel":
            continue  # the client stopped reading: nothing more to count
        if result.finals != 1:
            problems.append(f"victim stream {index}: {result.finals} finals ({result.error})")
        complete = result.error is None and len(result.token_ids()) == LONG["max_tokens"]
        if result.error is None and not complete:
            problems.append(
                f"victim stream {index}: cut short without an error ({len(result.token_ids())} tokens, one FINAL)"
            )
        if path in ("forward", "exit", "send") and result.error is None:
            problems.append(f"victim stream {index}: no error after the injected {path} fault")
        if path.startswith("stall") and result.error is not None:
            problems.append(f"victim stream {index}: an error after a stall its guard should contain: {result.error}")
    return problems


def bystander_problems(results: list) -> list[str]:
    problems = []
    for index, result in enumerate(results):
        if not isinstance(result, StreamResult):
            problems.append(f"bystander stream {index}: {type(result).__name__}: {result}")
        elif result.finals != 1 or result.error is not None or len(result.token_ids()) != BYSTANDER_TOKENS:
            problems.append(
                f"bystander stream {index}: finals={result.finals} error={result.error} "
                f"tokens={len(result.token_ids())}"
            )
    return problems


def control(server: ServerProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def restore(server: ServerProcess, victim: str, fault_file: Path) -> list[str]:
    """Switches off, the victim loaded again and ready."""
    for kind in ("", "exit", "send"):
        model_fault_file(fault_file, victim, kind).unlink(missing_ok=True)
    client = control(server)
    try:
        client.load_model(victim)
    except Exception as error:
        return [f"reloading {victim} failed: {error}"]
    finally:
        client.close()
    return [] if model_ready(server, victim) else [f"{victim} not ready after reloading"]


def one_run(server: ServerProcess, fault_file: Path, number: int, victim: str, path: str, streams: int) -> RunResult:
    started = time.monotonic()
    run = RunResult(number, victim, path)
    log_at = server.log_path.stat().st_size
    sampling = {**LONG, "max_tokens": BYSTANDER_TOKENS}
    bystanders = StreamGroup(server, BYSTANDER, 2, sampling)
    victims = StreamGroup(
        server, victim, 0 if path == "churn" else streams, LONG, cancel_after=3 if path == "cancel" else None
    )
    arrivals = Arrivals(server, victim, 8 if path == "churn" else 2)
    if not victims.wait_first(60) or not bystanders.wait_first(60):
        run.problems.append("streams did not start within 60 s")
    if path.startswith("stall"):
        stub_model = STAGES[(number // 2) % 2] if path == "stall_stage" else victim
        stubs = server.running_with(f"/{stub_model}/1/model.py")
        seconds = random.uniform(1.5, 5.0)
        run.path = f"{path} {stub_model} {seconds:.1f}s"
        for stub in stubs:
            stub.suspend()
        time.sleep(seconds)
        for stub in stubs:
            stub.resume()
    elif path == "churn":
        time.sleep(CHURN_SECONDS)
    elif path in ("forward", "exit", "send"):
        model_fault_file(fault_file, victim, "" if path == "forward" else path).touch()
    elif path == "unload":
        client = control(server)
        try:
            client.unload_model(victim)
        finally:
            client.close()
    run.problems += victim_problems(victims.join(120), path)
    run.problems += bystander_problems(bystanders.join(120))
    if path in ("forward", "exit", "unload"):
        wait_for(lambda: not model_ready(server, victim), timeout=60)  # arrivals meet the failure until then
    run.problems += arrivals.stop(90)
    if server.process.poll() is not None:
        run.problems.append(f"the server exited ({server.process.returncode})")
    else:
        if path in ("forward", "exit") and not wait_for(lambda: not model_ready(server, victim), timeout=60):
            run.problems.append(f"{victim} still ready 60 s after its engine failed")
        if path == "unload" and not wait_for(lambda: not model_ready(server, victim), timeout=60):
            run.problems.append(f"{victim} still ready 60 s after its unload")
        if path == "send":
            # Aborted streams, engine fine: the model stays in service.
            model_fault_file(fault_file, victim, "send").unlink(missing_ok=True)
            again = grpc_generate(server.grpc_url, victim, prompt="after", sampling={**LONG, "max_tokens": 4})
            if again.error is not None or again.finals != 1:
                run.problems.append(f"{victim} after failed sends: {again.error} finals={again.finals}")
        try:
            live = requests.get(f"{server.http_url}/v2/health/live", timeout=5).status_code == 200
        except requests.RequestException:
            live = False
        if not live:
            run.problems.append("/v2/health/live does not answer 200")
        if path in ("forward", "exit", "unload"):
            run.problems += restore(server, victim, fault_file)
    with server.log_path.open("rb") as log:
        log.seek(log_at)
        new = log.read().decode(errors="replace")
    run.problems += [f"log: {line.strip()}" for line in new.splitlines() if any(m in line for m in ABORT_MARKS)]
    if path.startswith("stall"):
        gave_up = ("is not healthy", "is lost")
        run.problems += [f"log: {line.strip()}" for line in new.splitlines() if any(m in line for m in gave_up)]
    run.seconds = time.monotonic() - started
    return run


def start(root: Path, fault_file: Path, attempt: int, extra_env: dict[str, str]) -> ServerProcess:
    repository = make_repository(root / f"server-{attempt}", MODELS)
    copy_pipeline_stages(repository)
    loads = [f"--load-model={name}" for name in (*MODELS, ENSEMBLE)]
    server, seconds = start_ready_server(
        repository,
        root / f"tritonserver-{attempt}.log",
        "--model-control-mode=explicit",
        *loads,
        env=server_environment(fault_file) | extra_env,
        timeout=600,
    )
    print(f"server {attempt} ready in {seconds:.0f} s (log {server.log_path})", flush=True)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--streams", type=int, default=4, help="victim streams per run")
    parser.add_argument("--cpu-load", type=int, default=1, help="busy processes beside the server")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/engine-failure-stress"))
    parser.add_argument("--output", type=Path, help="write the runs as JSON here")
    parser.add_argument(
        "--malloc-check",
        action="store_true",
        help="run the server with glibc's malloc checks (libc_malloc_debug, MALLOC_CHECK_=3, MALLOC_PERTURB_)",
    )
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    fault_file = args.log_dir / "fault"
    stop_load_at = time.time() + 24 * 3600
    burners = [multiprocessing.Process(target=_burn, args=(stop_load_at,), daemon=True) for _ in range(args.cpu_load)]
    for burner in burners:
        burner.start()
    plan = [
        (ENSEMBLE if path == "stall_stage" else victim, path)
        for victim, path in itertools.product((VICTIM_PROCESS, VICTIM_STUB), args.paths)
        if not (path == "exit" and victim == VICTIM_STUB)  # exiting an in-stub engine ends the stub
    ]
    extra_env = {}
    if args.malloc_check:
        extra_env = {"LD_PRELOAD": MALLOC_DEBUG_LIBRARY, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    attempt = 0
    server = start(args.log_dir, fault_file, attempt, extra_env)
    runs: list[RunResult] = []
    try:
        for number in range(args.runs):
            victim, path = plan[number % len(plan)]
            run = one_run(server, fault_file, number, victim, path, args.streams)
            runs.append(run)
            verdict = "ok" if not run.problems else "FAILED: " + "; ".join(run.problems[:6])
            print(f"run {number:3d} {victim:15s} {run.path:8s} {run.seconds:5.1f} s  {verdict}", flush=True)
            if run.problems:
                server.stop(timeout=30)
                attempt += 1
                server = start(args.log_dir, fault_file, attempt, extra_env)
    finally:
        server.stop(timeout=60)
        for burner in burners:
            burner.terminate()
    failed = [run for run in runs if run.problems]
    aborts = [run for run in failed if any(p.startswith("log:") or "exited" in p for p in run.problems)]
    print(
        f"{len(runs)} runs, {len(failed)} failed ({len(aborts)} with an abort or crash in the server log), "
        f"CPU load {args.cpu_load} busy process(es), {args.streams} victim streams, 2 bystander streams"
    )
    if args.output:
        args.output.write_text(json.dumps([run.__dict__ for run in runs], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
