"""Command line: `triton-vllm-multistep serve|build-demo-models|doctor`.

Owns argument parsing only; the work is in launcher and demo_models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import demo_models, launcher


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    for name in demo_models.DEMO_MODELS:
        demo_models.build(name)  # the shipped repository refers to demo://; build before Triton
    try:
        return launcher.serve(rest)
    except launcher.LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _build(args: argparse.Namespace, rest: list[str]) -> int:
    for name in args.names or sorted(demo_models.DEMO_MODELS):
        path = demo_models.build(name, args.output, force=args.force)
        print(f"{name}: {path}")
    return 0


def _doctor(args: argparse.Namespace, rest: list[str]) -> int:
    install = launcher.find_triton()
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
        help="run tritonserver with this backend; every other argument goes to tritonserver",
    )
    serve.set_defaults(handler=_serve)
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
