"""Server orchestration: one tritonserver per configuration, all kept running, levels run on them in turn.

Owns the model repository of each configuration, starting the servers (through
`testing.local_server.start_ready_server`), their idle memory, and the order in which levels run;
must not generate load itself (`load`) or judge results (`report`).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.served import load, peers
from benchmarks.served.offline import OfflineEngines
from benchmarks.served.settings import CONFIGS, KV_CACHE_GIB, MODEL, SOURCE_MODEL
from triton_vllm_multistep.testing import local_server
from triton_vllm_multistep.testing.local_server import ServerProcess
from triton_vllm_multistep.testing.vllm_serve import VllmServe


def make_repository(
    target: Path,
    steps: int,
    stream_mode: str,
    model: str,
    engine_fields: dict[str, Any] | None = None,
    parameters: dict[str, str] | None = None,
) -> Path:
    engine = {"num_scheduler_steps": steps, "model": model, **(engine_fields or {})}
    if (parameters or {}).get("vllm_engine") == "v1":
        engine["num_scheduler_steps"] = None  # a multi-step setting: a V1 model's load error
    parameters = {"stream_mode": stream_mode, **(parameters or {})}
    local_server.copy_model(SOURCE_MODEL, target / MODEL, engine, parameters)
    return target


def start_server(
    repository: Path, log_path: Path, *extra_args: str, environment: dict[str, str] | None = None
) -> tuple[ServerProcess, float]:
    """Start the launcher on free ports; returns the server and its seconds from start to READY."""
    env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **(environment or {})}
    return local_server.start_ready_server(repository, log_path, *extra_args, env=env, poll=0.05, attempts=3)


def logged_torch_threads(server: Any) -> int | None:
    """The torch threads the served engine runs with, from the model's ready line in the server log."""
    log = server.log_path.read_text(errors="replace")
    found = re.findall(r"ready: num_scheduler_steps=.*?torch threads (\d+)", log)
    return int(found[-1]) if found else None


def logged_attention_kernels(server: Any) -> str | None:
    """The attention kernels the served engine runs (IPEX or not), from the model's ready line."""
    found = re.findall(r"ready: .*?attention kernels (.*?), drains", server.log_path.read_text(errors="replace"))
    return found[-1] if found else None


def memory_of(server: Any) -> dict[str, float]:
    """Resident (RSS) and proportional (PSS) memory of tritonserver + stubs, in GB."""
    rss = pss = 0
    for proc in [p for group in server.process_groups().values() for p in group]:
        try:
            info = proc.memory_full_info()
        except Exception:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return {"rss_gb": rss / 1e9, "pss_gb": pss / 1e9}


def start_configuration(
    name: str, workdir: Path, model: str, triton_vllm_backend: Path | None
) -> tuple[ServerProcess | VllmServe, float]:
    """The server of one configuration (ours or a peer's); returns it and its seconds to READY."""
    config = CONFIGS[name]
    log = workdir / f"{name}.log"
    if config.server == peers.VLLM_SERVE:
        return peers.start_vllm_serve(model, log)
    if config.server == peers.VLLM_SERVE_V1:
        return peers.start_vllm_serve_v1(model, log, config.engine, config.environment)
    if config.server == peers.TRITON_VLLM_BACKEND:
        if triton_vllm_backend is None:
            raise SystemExit(f"configuration {name} needs --triton-vllm-backend (the vllm_backend repository's src/)")
        return peers.start_triton_vllm_backend(workdir / name, model, triton_vllm_backend, log)
    steps, mode = config.num_scheduler_steps, config.stream_mode
    repository = make_repository(workdir / name, steps, mode, model, config.engine, config.parameters)
    if config.server == load.BACKEND_OPENAI:
        (port,) = local_server.free_ports(1)
        started = time.monotonic()
        server, _ = start_server(repository, log, f"--openai-port={port}", environment=config.environment)
        server.wait_openai_ready()
        return server, time.monotonic() - started
    return start_server(repository, log, environment=config.environment)


def start_order(names: list[str], pass_index: int) -> list[str]:
    """The order a pass starts its servers in: as named, then reversed, alternately. On this host the
    server started first runs its forward pass up to ~10% slower than the same configuration started
    later, whatever it is (docs/performance.md, "the start position"): in two passes the configurations
    named first and last each start first once (one named between them never does)."""
    return list(names) if pass_index % 2 == 0 else list(reversed(names))


def run_served(
    names: list[str],
    concurrencies: list[int],
    max_tokens: int,
    wave_scale: float,
    workdir: Path,
    model: str,
    offline: OfflineEngines | None = None,
    triton_vllm_backend: Path | None = None,
    passes: int = 1,
) -> list[dict[str, Any]]:
    """One server per configuration, started one after the other (start-up and idle memory are
    measured while the others idle), then every concurrency level on all of them, interleaved. With
    `passes` > 1 all of that again on new servers, started in the other order (`start_order`); each
    configuration's figures are over the waves of every pass (start-up and memory: the first pass)."""
    served: dict[str, dict[str, Any]] = {}
    tallies: dict[int, dict[str, load.LevelTally]] = {concurrency: {} for concurrency in concurrencies}
    for pass_index in range(passes):
        order = start_order(names, pass_index)
        if passes > 1:
            print(f"pass {pass_index + 1} of {passes}: servers started in the order {', '.join(order)}", flush=True)
        servers: dict[str, Any] = {}
        pass_dir = workdir / f"pass{pass_index}"  # each pass's repositories and logs
        pass_dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in order:
                config = CONFIGS[name]
                server, ready = start_configuration(name, pass_dir, model, triton_vllm_backend)
                servers[name] = server
                print(f"{config.label}: READY after {ready:.1f} s", flush=True)
                time.sleep(3.0)  # let start-up allocations settle before reading idle memory
                if name not in served:  # start-up and idle memory: the first pass's
                    served[name] = {
                        "name": name,
                        "label": config.label,
                        "num_scheduler_steps": config.num_scheduler_steps,
                        "stream_mode": config.stream_mode,
                        "server": config.server,
                        "ready_seconds": ready,
                        "torch_threads": logged_torch_threads(server),
                        "attention_kernels": logged_attention_kernels(server),
                        "idle_memory": memory_of(server),
                        "passes": passes,
                        "levels": [],
                    }
            # Rounds keep the named order in every pass, so that wave k of each configuration is one round.
            ordered = {name: servers[name] for name in names}
            for index, concurrency in enumerate(concurrencies):
                waves = load.waves_for(concurrency, wave_scale)
                asyncio.run(
                    load.run_level(
                        ordered,
                        {name: CONFIGS[name].server for name in names},
                        concurrency,
                        waves,
                        max_tokens,
                        10_000 * (index + 1),
                        offline,
                        {name: CONFIGS[name].client_outputs for name in names},
                        tallies[concurrency],
                    )
                )
                for name in names:
                    level = load.summarize(tallies[concurrency][name], concurrency, waves, max_tokens)
                    print(
                        f"  {served[name]['label']}, c={concurrency:3d}: {level['tokens_per_s']:8.1f} tok/s"
                        f"  ttft p50 {level['ttft_ms']['p50']:.1f} ms  itl p50 {level['itl_ms']['p50']:.2f} ms"
                        f"  errors {level['errors']}" + (f"  (passes so far: {pass_index + 1})" if passes > 1 else ""),
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    for concurrency in concurrencies:
        waves = load.waves_for(concurrency, wave_scale)
        for name in names:
            served[name]["levels"].append(load.summarize(tallies[concurrency][name], concurrency, waves, max_tokens))
    return [served[name] for name in names]
