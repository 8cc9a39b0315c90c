"""The launcher: real tritonserver start/stop, config choice, repository checks, device env."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from triton_vllm_multistep.host import launcher
from triton_vllm_multistep.stub.device import gpu_count, instance_device_environment
from triton_vllm_multistep.testing.local_server import start_server

ECHO_REPOSITORY = Path(__file__).parent / "assets" / "echo_repository"
HOLD_REPOSITORY = Path(__file__).parent / "assets" / "hold_repository"


def test_launcher_serves_and_sigterm_leaves_no_processes(tmp_path: Path) -> None:
    server = start_server(ECHO_REPOSITORY, tmp_path / "server.log")
    try:
        server.wait_ready(timeout=120)
        client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        item = httpclient.InferInput("INPUT", [1], "BYTES")
        item.set_data_from_numpy(np.array([b"ping"], dtype=np.object_))
        assert client.infer("echo", [item]).as_numpy("OUTPUT")[0] == b"ping"
        client.close()  # an open keep-alive connection would hold shutdown for its exit timeout
        children = server.descendants()
        names = {child.name() for child in children}
        assert "tritonserver" in names, names
        assert any("triton_python_backend_stub" in child.cmdline()[0] for child in children), names
    finally:
        code = server.stop(timeout=60)
    assert code == 0, server.log_tail()
    time.sleep(0.5)
    alive = [child for child in children if child.is_running() and child.status() != "zombie"]
    assert not alive, f"left behind: {alive}"


def test_launcher_kills_a_server_still_running_past_its_exit_timeout(tmp_path: Path) -> None:
    """A model that never sends its FINAL keeps tritonserver 2.51 from exiting after its exit timeout
    expired (it hangs in its exit path): the launcher kills the server's process group instead."""
    exit_timeout = 2
    server = start_server(HOLD_REPOSITORY, tmp_path / "server.log", f"--exit-timeout-secs={exit_timeout}")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        server.wait_ready(timeout=120)
        children = server.descendants()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        item = grpcclient.InferInput("INPUT", [1], "BYTES")
        item.set_data_from_numpy(np.array([b"held"], dtype=np.object_))
        client.async_stream_infer("hold", [item])
        result, error = responses.get(timeout=60)  # in the model, which now holds it forever
        assert error is None and result.as_numpy("OUTPUT")[0] == b"held"
        started = time.monotonic()
        server.process.send_signal(15)
        code = server.process.wait(exit_timeout + launcher.EXIT_GRACE_SECONDS + 30)
        took = time.monotonic() - started
    finally:
        client.close()
        server.stop()
    log = server.log_tail(20)
    assert "Exit timeout expired" in log, log
    assert code != 0, log
    assert took < exit_timeout + launcher.EXIT_GRACE_SECONDS + 5, took
    if took > exit_timeout + launcher.EXIT_GRACE_SECONDS:  # tritonserver did hang: we killed it
        assert code == 1 and "did not exit within its exit timeout (2 s) + 15 s" in log, (code, log)
    time.sleep(0.5)
    alive = [child for child in children if child.is_running() and child.status() != "zombie"]
    assert not alive, f"left behind: {alive}"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "holds no model folders"),
        (lambda root: (root / "bad" / "m").mkdir(parents=True) or root / "bad", "neither config.pbtxt"),
    ],
)
def test_invalid_model_repository_fails_fast_with_a_clear_error(tmp_path: Path, make, message: str) -> None:
    repository = make(tmp_path)
    started = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "triton_vllm_multistep", "serve", f"--model-repository={repository}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2
    assert message in completed.stderr
    assert time.monotonic() - started < 60  # no hang waiting for a server that cannot start


def test_broken_model_makes_server_exit_instead_of_hanging(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "config.pbtxt").write_text('backend: "python"\nthis is not protobuf text\n')
    server = start_server(repository, tmp_path / "server.log")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.wait_ready(timeout=120)
    finally:
        server.stop()


def test_cpu_config_chosen_without_gpu_and_default_with_gpu(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "m"
    (model / "configs").mkdir(parents=True)
    (model / "config.pbtxt").write_text("")
    assert launcher.choose_config_name([tmp_path / "repo"], gpus=1) is None
    assert launcher.choose_config_name([tmp_path / "repo"], gpus=0) is None  # no cpu.pbtxt shipped
    (model / "configs" / "cpu.pbtxt").write_text("")
    assert launcher.choose_config_name([tmp_path / "repo"], gpus=0) == "cpu"
    assert launcher.choose_config_name([tmp_path / "repo"], gpus=2) is None


def test_build_command_keeps_user_flags_and_adds_ours(tmp_path: Path) -> None:
    install = launcher.find_triton()
    repo = Path(__file__).resolve().parents[2] / "model_repository"
    ours = launcher.build_command(install, tmp_path, [f"--model-repository={repo}"])
    assert f"--backend-directory={tmp_path}" in ours
    mine = launcher.build_command(
        install, tmp_path, ["--model-repository", str(repo), "--model-config-name=custom", "--backend-directory=/x"]
    )
    assert "--model-config-name=custom" in mine and "--backend-directory=/x" in mine
    assert not any(arg.startswith("--model-config-name=cpu") for arg in mine)


def test_gpu_count_reads_device_nodes_and_visibility(tmp_path: Path) -> None:
    for node in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / node).touch()
    assert gpu_count({}, dev=tmp_path) == 2
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "1"}, dev=tmp_path) == 1
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}, dev=tmp_path) == 0
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}, dev=tmp_path) == 0
    assert gpu_count({"TRITON_VLLM_MULTISTEP_DEVICE": "cpu"}, dev=tmp_path) == 0
    assert gpu_count({}, dev=tmp_path / "nothing") == 0


def test_instance_device_environment_per_kind() -> None:
    assert instance_device_environment("GPU", 3, 1) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert instance_device_environment("CPU", 0, 1) == {"CUDA_VISIBLE_DEVICES": ""}
    assert instance_device_environment("MODEL", 0, 4) == {}
    with pytest.raises(ValueError, match="KIND_MODEL"):
        instance_device_environment("GPU", 0, 2)
    with pytest.raises(ValueError, match="unsupported instance kind"):
        instance_device_environment("TPU", 0, 1)


def test_backend_directory_holds_python_backend_stub_and_our_model_py(tmp_path: Path) -> None:
    install = launcher.find_triton()
    target = launcher.prepare_backend_dir(install, tmp_path / "backends")
    assert (target / "python" / "libtriton_python.so").exists()
    assert (target / "python" / "triton_python_backend_stub").stat().st_mode & 0o111
    assert (target / "vllm_multistep" / "model.py").read_text() == launcher.BACKEND_MODEL_PY.read_text()
