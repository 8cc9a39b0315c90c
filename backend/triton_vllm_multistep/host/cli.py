"""Command line: `triton-vllm-multistep serve|drain|probe|install-backend|build-demo-models|doctor`.

Owns argument parsing only; the work is in host/launcher.py, host/probe.py, lifecycle/server_drain.py
and demo/models.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.demo import smollm2
from triton_vllm_multistep.host import launcher, probe
from triton_vllm_multistep.lifecycle import procfs, server_drain, triton_command
from triton_vllm_multistep.lifecycle.protocol import DRAIN_FILE_ENV

SERVE_OPTIONS_HELP = "launcher options:\n" + "\n".join(
    f"  {name:<28}{text}"
    for name, text in (
        ("--openai-port PORT", "an OpenAI-compatible API on PORT beside tritonserver (docs/openai.md)"),
        ("--openai-host HOST", "the address it binds (default 0.0.0.0)"),
        ("--openai-api-key KEY", "requests to it must carry this bearer key"),
        ("--openai-args 'OPTIONS'", "further `vllm serve` options for it"),
        (
            launcher.RESTART_OPTION,
            "start tritonserver again when it dies without being asked to stop (counted "
            "in vllm_multistep:server_restarts_total; docs/lifecycle.md)",
        ),
    )
)


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    for name in demo_models.DEMO_MODELS:
        demo_models.build(name)  # the shipped repository refers to demo://; build before Triton
    if smollm2.cache_problem(demo_models.cache_root() / smollm2.NAME) is not None:
        # The real model, converted once per machine (~30 s) before Triton rather than in a stub,
        # in a child process: the launcher lives as long as the server and should not hold torch.
        build = [sys.executable, "-m", "triton_vllm_multistep", "build-demo-models", smollm2.NAME]
        if subprocess.run(build, check=False).returncode != 0:
            print(f"warning: models that use demo://{smollm2.NAME} will not load", file=sys.stderr)
    try:
        return launcher.serve(rest)
    except launcher.LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _drain(args: argparse.Namespace, rest: list[str]) -> int:
    drain_file = args.drain_file or os.environ.get(DRAIN_FILE_ENV)
    if not drain_file:
        print(
            f"error: no drain file: set {DRAIN_FILE_ENV} for the server and this command (or pass --drain-file)",
            file=sys.stderr,
        )
        return 2
    servers = server_drain.tritonserver_pids(Path(drain_file))
    if not servers:
        print(f"error: no running tritonserver has {DRAIN_FILE_ENV}={drain_file}", file=sys.stderr)
        return 1
    busy = 0
    for pid in servers:
        timeout = args.timeout
        if timeout is None:  # the server's own exit timeout: the drain itself fits in it
            timeout = triton_command.exit_timeout_of(triton_command.of_process(pid))
        result = server_drain.drain_server(pid, Path(drain_file), launcher.BACKEND_NAME, timeout=timeout)
        busy += len(result.busy)
        print(
            f"tritonserver {pid}: {len(result.stubs)} {launcher.BACKEND_NAME} model instance(s), "
            f"{len(result.stubs) - len(result.busy)} drained in {result.seconds:.1f} s"
        )
    return 1 if busy else 0


def _probe(args: argparse.Namespace, rest: list[str]) -> int:
    # --timeout counts from the process's start: the kubelet's timeoutSeconds includes the interpreter's
    # start-up and imports, which take a second or more on a loaded node.
    started = procfs.age(os.getpid()) or 0.0
    healthy, lines = probe.run(
        args.drain_file or os.environ.get(DRAIN_FILE_ENV),
        args.model,
        args.readiness,
        max(probe.MIN_TIMEOUT_SECONDS, args.timeout - started),
    )
    print("\n".join(lines), file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


def _install_backend(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        target = launcher.install_backend(args.backends_dir)
    except launcher.LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"installed {target}")
    # The installed model.py imports this package in the stub's Python: say so if that is not this one.
    try:
        launcher.system_stub(args.backends_dir / "python", f"{sys.version_info.major}.{sys.version_info.minor}")
    except launcher.LaunchError as error:
        print(f"warning: {error}", file=sys.stderr)
    return 0


def _build(args: argparse.Namespace, rest: list[str]) -> int:
    for name in args.names or demo_models.all_names():
        try:
            path = demo_models.build(name, args.output, force=args.force)
        except smollm2.DemoModelError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    return 0


def _doctor(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        install = launcher.find_triton()
    except launcher.LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"tritonserver: {install.server}")
    print(f"python backend stub: {install.stub}")
    print(f"GPUs visible: {launcher.gpu_count()}")
    missing = [p for p in (install.server, install.stub) if not p.exists()]
    for path in missing:
        print(f"missing: {path}", file=sys.stderr)
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-vllm-multistep", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        description="Run tritonserver with this backend installed. The options below are the launcher's own; "
        "every other argument goes to tritonserver (e.g. --model-repository DIR, --http-port 9000).",
        epilog=SERVE_OPTIONS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run tritonserver with this backend; every other argument goes to tritonserver, except "
        "--openai-port PORT (an OpenAI-compatible API beside it) and --openai-host, --openai-api-key, "
        "--openai-args 'vLLM serve options' (docs/openai.md), and --restart-on-crash (start tritonserver again "
        "when it dies without being asked to stop, counted in vllm_multistep:server_restarts_total; "
        "docs/lifecycle.md)",
    )
    serve.set_defaults(handler=_serve)
    drain = commands.add_parser(
        "drain",
        help="have the running tritonserver's LLM models finish or end their streams before it is stopped "
        "(e.g. a Kubernetes preStop hook)",
    )
    drain.add_argument("--drain-file", default=None, help=f"the server's {DRAIN_FILE_ENV} (default: from the env)")
    drain.add_argument(
        "--timeout", type=float, default=None, help="seconds to wait per server (default: its --exit-timeout-secs)"
    )
    drain.set_defaults(handler=_drain)
    checks = commands.add_parser(
        "probe",
        help="exit 0 if the running tritonserver's models are healthy, 1 if not (a Kubernetes exec probe; "
        "catches a failed engine and a dead stub, which Triton's health endpoints do not)",
    )
    checks.add_argument("--model", action="append", default=[], help="model to check (default: --load-model's)")
    checks.add_argument("--readiness", action="store_true", help="a server asked to drain is not ready either")
    checks.add_argument(
        "--timeout",
        type=float,
        default=probe.DEFAULT_TIMEOUT_SECONDS,
        help="seconds in all, counted from the process's start",
    )
    checks.add_argument("--drain-file", default=None, help=f"the server's {DRAIN_FILE_ENV} (default: from the env)")
    checks.set_defaults(handler=_probe)
    install = commands.add_parser(
        "install-backend",
        help=f"install the backend's entry point as <backends-dir>/{launcher.BACKEND_NAME}/model.py "
        "(for running tritonserver directly, e.g. in NVIDIA's image)",
    )
    install.add_argument(
        "--backends-dir",
        type=Path,
        default=launcher.SYSTEM_TRITON / "backends",
        help="Triton's backends directory (default: %(default)s)",
    )
    install.set_defaults(handler=_install_backend)
    build = commands.add_parser("build-demo-models", help="build the local demo models")
    build.add_argument("names", nargs="*")
    build.add_argument("--output", type=Path, default=None)
    build.add_argument("--force", action="store_true")
    build.set_defaults(handler=_build)
    commands.add_parser("doctor", help="check the server binaries").set_defaults(handler=_doctor)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.handler(args, rest)


if __name__ == "__main__":
    sys.exit(main())
