"""Launches a real `tritonserver` with this project's backend installed and configs chosen.

Owns finding the server, laying out the backend directory, the environment and the child's
lifetime; must not know anything about models beyond which config file to select.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from triton_vllm_multistep.demo import models as demo_models
from triton_vllm_multistep.host import openai_process, stub_python
from triton_vllm_multistep.lifecycle import procfs, triton_command
from triton_vllm_multistep.lifecycle.protocol import DRAIN_FILE_ENV, EXIT_GRACE_SECONDS
from triton_vllm_multistep.lifecycle.server_drain import DrainResult, drain_server
from triton_vllm_multistep.settings.v1_environment import V1_PYTHON_ENV, v1_environment_python
from triton_vllm_multistep.stub.device import gpu_count
from triton_vllm_multistep.stubguard import records

BACKEND_NAME = "vllm_multistep"
SYSTEM_TRITON = Path("/opt/tritonserver")
STUBS_PER_VERSION = "python_backend_stubs"  # <python backend>/python_backend_stubs/3.X/, as in nvidia-pytriton
CPU_CONFIG_NAME = "cpu"
# The Triton entry point ships inside the package (stub/model.py), so a wheel install has it.
BACKEND_MODEL_PY = Path(__file__).resolve().parent.parent / "stub" / "model.py"
# The directory holding the package: on PYTHONPATH for the stub (an editable install's .pth is
# not read from PYTHONPATH).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """The server cannot be started as asked; the message says why and what to do."""


@dataclass(frozen=True)
class TritonInstall:
    """Where a usable tritonserver and its Python backend live."""

    server: Path
    python_backend: Path  # folder holding libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub matching the interpreter that will run models
    library_dirs: tuple[Path, ...]  # prepended to LD_LIBRARY_PATH


def find_triton(system_root: Path = SYSTEM_TRITON, python_version: str | None = None) -> TritonInstall:
    """A system install (e.g. NVIDIA's container) first, else the one bundled in nvidia-pytriton.

    Either way the stub must embed the Python running this launcher (`python_version`, "3.X"):
    the stub gets this environment's packages on its PYTHONPATH, and vLLM, torch and numpy built
    for one Python do not import in another.
    """
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    libpython_dir = Path(sysconfig.get_config_var("LIBDIR") or sys.base_prefix + "/lib")
    if (system_root / "bin" / "tritonserver").exists():
        backend = system_root / "backends" / "python"
        return TritonInstall(
            server=system_root / "bin" / "tritonserver",
            python_backend=backend,
            stub=system_stub(backend, version),
            library_dirs=(system_root / "lib", libpython_dir),
        )
    # Locate, not import: pytriton's own Python package needs dependencies we do not install.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(
            "no tritonserver found: neither /opt/tritonserver nor the nvidia-pytriton wheel (run scripts/setup.sh)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise LaunchError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    return TritonInstall(
        server=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=stub,
        # libpython of the running interpreter first, so the stub embeds this same Python.
        library_dirs=(libpython_dir, root.parent.parent / "nvidia_pytriton.libs"),
    )


def system_stub(python_backend: Path, version: str) -> Path:
    """The system Python backend's stub for Python `version`: its own stub, or one built per version.

    Triton's images ship one stub, built for the image's Python (3.10 in 24.10). A stub built for
    another Python can be put at python_backend_stubs/3.X/ (nvidia-pytriton's layout).
    """
    candidates = [
        python_backend / "triton_python_backend_stub",
        python_backend / STUBS_PER_VERSION / version / "triton_python_backend_stub",
    ]
    mismatched = []
    for stub in candidates:
        if not stub.exists():
            continue
        try:
            embedded = stub_python.embedded_python(stub)
        except (OSError, stub_python.NotAnElf) as error:
            raise LaunchError(f"cannot read the Python backend stub {stub}: {error}") from error
        if embedded is None or embedded == version:  # None: links no libpython (static), cannot tell
            return stub
        mismatched.append(f"{stub} embeds Python {embedded}")
    if not mismatched:
        raise LaunchError(f"{python_backend} has no triton_python_backend_stub: not a Triton Python backend")
    raise LaunchError(
        f"no Python backend stub for Python {version} (this launcher runs {sys.executable}): "
        f"{'; '.join(mismatched)}. The stub loads this environment's packages (vLLM, torch, numpy), which only "
        f"import in the Python they were installed for. Either install triton-vllm-multistep and vLLM for the "
        f"stub's Python and run the launcher with it (in NVIDIA's image: python3 -m pip install ..., as "
        f"docker/Dockerfile does), or build the Python backend stub for Python {version} (Triton's python_backend "
        f"repository, same release as the server) and put it at "
        f"{python_backend / STUBS_PER_VERSION / version / 'triton_python_backend_stub'} (see docs/deployment.md)"
    )


def install_backend(backends_dir: Path) -> Path:
    """Install this backend's entry point as `<backends_dir>/vllm_multistep/model.py`; returns that path."""
    if not backends_dir.is_dir():
        raise LaunchError(f"{backends_dir} is not a directory: pass Triton's backends directory")
    if not (backends_dir / "python").is_dir():
        raise LaunchError(
            f"{backends_dir} has no python/ folder: {BACKEND_NAME} is a Python-based backend and needs "
            "Triton's Python backend in the same backends directory"
        )
    if not BACKEND_MODEL_PY.exists():
        raise LaunchError(f"backend entry point {BACKEND_MODEL_PY} is missing")
    target = backends_dir / BACKEND_NAME / "model.py"
    target.parent.mkdir(exist_ok=True)
    _copy_if_changed(BACKEND_MODEL_PY, target)
    return target


def prepare_backend_dir(install: TritonInstall, target: Path) -> Path:
    """Lay out `target` as a --backend-directory: Triton's Python backend + ours as a Python-based backend."""
    python_dir = target / "python"
    ours = target / BACKEND_NAME
    python_dir.mkdir(parents=True, exist_ok=True)
    ours.mkdir(parents=True, exist_ok=True)
    for source in install.python_backend.iterdir():
        if source.is_file():
            _copy_if_changed(source, python_dir / source.name)
    _copy_if_changed(install.stub, python_dir / "triton_python_backend_stub")
    if not BACKEND_MODEL_PY.exists():
        raise LaunchError(f"backend entry point {BACKEND_MODEL_PY} is missing")
    _copy_if_changed(BACKEND_MODEL_PY, ours / "model.py")
    return target


def _copy_if_changed(source: Path, dest: Path) -> None:
    if dest.exists() and dest.stat().st_size == source.stat().st_size:
        if dest.read_bytes() == source.read_bytes():
            return
    shutil.copy2(source, dest)


def server_environment(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its stubs: libraries, this venv's packages, V0 vLLM."""
    env = dict(os.environ if base is None else base)
    lib_path = [str(d) for d in install.library_dirs]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The stub embeds libpython, which knows nothing of this environment: give it this
    # package first (the one the launcher runs), then every import path of this interpreter
    # (venv, .pth and --system-site-packages entries included: .pth files are not read from
    # PYTHONPATH), but not its standard library (the stub has its own).
    python_path = [str(PACKAGE_PARENT), *environment_import_paths()]
    if env.get("PYTHONPATH"):
        python_path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(python_path))
    env.setdefault("VLLM_USE_V1", "0")
    v1_python = v1_environment_python()
    if v1_python is not None:
        env.setdefault(V1_PYTHON_ENV, str(v1_python))
    return env


def environment_import_paths() -> list[str]:
    """This interpreter's package directories: sys.path without the standard library and the cwd."""
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")}
    script_dir = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else None
    found = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry) or entry in (os.getcwd(), script_dir):
            continue
        real = os.path.realpath(entry)
        in_stdlib = any(real == s or real.startswith(s + os.sep) for s in stdlib)
        if in_stdlib and not {"site-packages", "dist-packages"} & set(Path(real).parts):
            continue
        found.append(entry)
    return found


def validate_model_repository(repository: Path) -> None:
    """Fail fast, before Triton starts, on a repository that cannot possibly load."""
    if not repository.exists():
        raise LaunchError(f"model repository {repository} does not exist")
    if not repository.is_dir():
        raise LaunchError(f"model repository {repository} is not a directory")
    models = [p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if not models:
        raise LaunchError(f"model repository {repository} holds no model folders")
    for model in models:
        if not (model / "config.pbtxt").exists() and not any(
            child.is_dir() and child.name.isdigit() for child in model.iterdir()
        ):
            raise LaunchError(f"model folder {model} has neither config.pbtxt nor a numeric version folder")


def choose_config_name(repositories: Sequence[Path], gpus: int | None = None) -> str | None:
    """`cpu` when no GPU is visible and some model ships configs/cpu.pbtxt; else Triton's default."""
    if (gpu_count() if gpus is None else gpus) > 0:
        return None
    for repository in repositories:
        if any((m / "configs" / f"{CPU_CONFIG_NAME}.pbtxt").exists() for m in repository.iterdir()):
            return CPU_CONFIG_NAME
    return None


def build_command(install: TritonInstall, backend_dir: Path, server_args: Sequence[str]) -> list[str]:
    """Full tritonserver argv: the user's flags win; ours fill in what they left out."""
    args = list(server_args)
    repositories = [Path(p) for p in triton_command.option_values(args, "--model-repository")]
    if not repositories:
        raise LaunchError("--model-repository is required")
    for repository in repositories:
        validate_model_repository(repository)
    if not triton_command.option_values(args, "--backend-directory"):
        args.append(f"--backend-directory={backend_dir}")
    if not triton_command.option_values(args, "--model-config-name"):
        config_name = choose_config_name(repositories)
        if config_name:
            args.append(f"--model-config-name={config_name}")
    return [str(install.server), *args]


RESTART_OPTION = "--restart-on-crash"
# A server dying this soon after its start this many times in a row is not restarted again.
SHORT_RUN_SECONDS = 60.0
MAX_SHORT_RUNS = 3


def serve(server_args: Sequence[str], backend_dir: Path | None = None) -> int:
    """Run tritonserver in the foreground (and the OpenAI server beside it with --openai-port); on
    SIGINT/SIGTERM drain its LLM models, then stop it; return its code. A server that exits without
    being asked to (a crash, or a stub guard taking it down) is named with its cause from the stub
    guards' records, and with --restart-on-crash started again."""
    restart_on_crash = RESTART_OPTION in server_args
    server_args = [arg for arg in server_args if arg != RESTART_OPTION]
    try:
        openai_options, server_args = openai_process.split_options(server_args)
    except openai_process.OpenAIOptionError as error:
        raise LaunchError(str(error)) from None
    install = find_triton()
    backend_dir = prepare_backend_dir(install, backend_dir or demo_models.cache_home() / "backends" / BACKEND_NAME)
    command = build_command(install, backend_dir, server_args)
    print("[triton-vllm-multistep] " + " ".join(command), file=sys.stderr, flush=True)
    env = server_environment(install)
    exit_timeout = triton_command.exit_timeout_of(triton_command.parse(command))
    try:
        openai_command = (
            openai_process.command(openai_options, command, shutdown_timeout=exit_timeout) if openai_options else None
        )
    except openai_process.OpenAIOptionError as error:
        raise LaunchError(str(error)) from None
    # A drain file of the server's own unless the user named one (e.g. for `triton-vllm-multistep drain`),
    # and the stub guards' record file beside it.
    own_dir = Path(tempfile.mkdtemp(prefix="triton-vllm-multistep-"))
    for name, default in ((DRAIN_FILE_ENV, own_dir / "drain"), (records.RECORDS_ENV, own_dir / "stalls.jsonl")):
        if not env.get(name):
            env[name] = str(default)
    record_file = Path(env[records.RECORDS_ENV])
    session = _Session()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, session.on_signal)
    restarts = short_runs = 0
    try:
        while True:
            env[records.SERVER_RESTARTS_ENV] = str(restarts)
            seen = len(records.read(record_file))
            started = time.monotonic()
            code = _run_server(session, command, env, openai_command, exit_timeout)
            if session.stops or session.forwarded or code == 0:
                return code
            found = records.read(record_file)[seen:]
            cause = records.crash_cause(found if code < 0 else [r for r in found if r.kind == records.LOST])
            if code > 0 and cause is None:
                return code  # it stopped itself (e.g. a model failed to load): its log says why
            print(
                f"[triton-vllm-multistep] tritonserver {_describe_exit(code)} without being asked to stop"
                + (f": {cause}" if cause else " (no stub guard recorded a cause; see its log above)"),
                file=sys.stderr,
                flush=True,
            )
            if not restart_on_crash:
                return _exit_status(code)
            if session.stops:
                return 1
            short_runs = short_runs + 1 if time.monotonic() - started < SHORT_RUN_SECONDS else 0
            if short_runs >= MAX_SHORT_RUNS:
                print(
                    f"[triton-vllm-multistep] {RESTART_OPTION}: not again: it died within {SHORT_RUN_SECONDS:g} s "
                    f"of its start {short_runs} times in a row",
                    file=sys.stderr,
                    flush=True,
                )
                return _exit_status(code)
            restarts += 1
            print(
                f"[triton-vllm-multistep] {RESTART_OPTION}: starting it again (restart {restarts})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(own_dir, ignore_errors=True)


class _Session:
    """The server being run and the stop requests received (SIGINT/SIGTERM: the first drains, a second
    stops at once), shared with the signal handler across restarts."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.stops: list[int] = []
        self.forwarded: list[int] = []  # SIGHUP/SIGQUIT passed on to tritonserver: its exit is asked for

    def on_signal(self, signum: int, _frame: object) -> None:
        process = self.process
        if signum in (signal.SIGINT, signal.SIGTERM):
            self.stops.append(signum)
            if len(self.stops) == 1:
                return  # the main loop drains first
        if process is not None and process.poll() is None:
            if signum not in (signal.SIGINT, signal.SIGTERM):
                self.forwarded.append(signum)
            process.send_signal(signum)


def _exit_status(code: int) -> int:
    """The launcher's exit status for tritonserver's return code (a signal N: 128 + N, as a shell says)."""
    return code if code > 0 else 128 - code


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _run_server(
    session: _Session, command: list[str], env: dict[str, str], openai_command: list[str] | None, exit_timeout: float
) -> int:
    """One tritonserver (and its OpenAI server) from start to exit; its exit code."""
    # Own process group: a signal to the launcher reaches Triton once, via us, and Triton
    # shuts its stubs (and their vLLM workers) down itself.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    session.process = process
    stops = session.stops
    if stops:  # asked to stop while the previous server was restarting
        process.send_signal(stops[0])
    # The OpenAI server waits for READY itself; it goes first when the server is asked to stop.
    frontend = openai_process.start(openai_command, env) if openai_command else None
    frontend_failed = False
    kill_at: float | None = None
    try:
        while True:
            try:
                code = process.wait(timeout=0.2)
                return code or int(frontend_failed)
            except subprocess.TimeoutExpired:
                pass
            if frontend is not None and not stops and frontend.poll() is not None:
                # Serving without the API it was started for would hide the failure: stop it all.
                print(
                    f"[triton-vllm-multistep] the OpenAI server exited ({frontend.returncode}): stopping tritonserver",
                    file=sys.stderr,
                    flush=True,
                )
                frontend_failed = True
                stops.append(signal.SIGTERM)
            if stops and kill_at is None:
                if frontend is not None:
                    openai_process.stop(frontend)
                _drain_then_stop(process, Path(env[DRAIN_FILE_ENV]), exit_timeout, stops)
                kill_at = time.monotonic() + exit_timeout + EXIT_GRACE_SECONDS
            if kill_at is not None and time.monotonic() > kill_at:
                print(
                    "[triton-vllm-multistep] tritonserver did not exit within its exit timeout "
                    f"({exit_timeout:g} s) + {EXIT_GRACE_SECONDS:g} s after being asked to stop: killing it",
                    file=sys.stderr,
                    flush=True,
                )
                _reap_group(process.pid)
                process.wait()
                return 1
    finally:
        _reap_group(process.pid)
        if frontend is not None:
            openai_process.kill(frontend)


def _drain_then_stop(process: subprocess.Popen, drain_file: Path, exit_timeout: float, stops: list[int]) -> None:
    """Let the LLM models finish or end their streams while Triton still runs ensembles, then signal it."""
    try:
        result = drain_server(
            process.pid, drain_file, BACKEND_NAME, timeout=exit_timeout, give_up=lambda: len(stops) > 1
        )
    except Exception as error:  # the stop must go on: Triton then drains what it can itself
        print(f"[triton-vllm-multistep] could not drain the models first: {error}", file=sys.stderr, flush=True)
    else:
        _report_drain(result, process.pid)
    if process.poll() is None and len(stops) == 1:
        process.send_signal(stops[0])


def _report_drain(result: DrainResult, server_pid: int) -> None:
    if not result.stubs:
        print(
            f"[triton-vllm-multistep] no {BACKEND_NAME} model instance found among tritonserver's processes "
            f"({_children_summary(server_pid)}): stopping it without draining first",
            file=sys.stderr,
            flush=True,
        )
    else:
        state = f"{len(result.busy)} still busy" if result.busy else "all drained"
        print(
            f"[triton-vllm-multistep] drained {len(result.stubs)} model instance(s) in {result.seconds:.1f} s "
            f"({state}); stopping tritonserver",
            file=sys.stderr,
            flush=True,
        )


def _children_summary(server_pid: int) -> str:
    """What runs below tritonserver, for the log when no instance to drain was found."""
    found = []
    for pid in procfs.children(server_pid):
        argv = procfs.cmdline(pid)
        found.append(f"{pid}: {' '.join(argv[:1] + argv[-1:])}")
    return "; ".join(found) or "none"


def _reap_group(pgid: int) -> None:
    """Kill anything left in the server's process group (a stub or worker that outlived it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
