"""The test harness's port choice: free ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from triton_vllm_multistep.testing import local_server


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = local_server.ephemeral_port_range()
    ports = local_server.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        assert not low <= port <= high, (port, low, high)
        with socket.socket() as server_socket:
            server_socket.bind(("0.0.0.0", port))


def test_the_range_is_read_from_the_kernel_and_ports_stay_out_of_it(tmp_path, monkeypatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t64000\n")
    monkeypatch.setattr(local_server, "EPHEMERAL_RANGE_FILE", range_file)
    assert local_server.ephemeral_port_range() == (20000, 64000)
    for port in local_server.free_ports(20):
        assert local_server.LOWEST_CHOSEN_PORT <= port < 20000 or port > 64000


def test_a_port_in_use_is_never_chosen(tmp_path, monkeypatch) -> None:
    # The range file leaves two candidates, 65534 (taken here) and 65535.
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{local_server.LOWEST_CHOSEN_PORT} 65533\n")
    monkeypatch.setattr(local_server, "EPHEMERAL_RANGE_FILE", range_file)
    with socket.socket() as taken, socket.socket() as other:
        try:
            taken.bind(("127.0.0.1", 65534))
            other.bind(("0.0.0.0", 65535))
        except OSError:
            pytest.skip("ports 65534/65535 are in use on this host")
        other.close()
        assert {local_server.free_ports(1)[0] for _ in range(10)} == {65535}
        with pytest.raises(RuntimeError, match="no 2 free ports"):
            local_server.free_ports(2)


def test_missing_range_file_falls_back_to_linux_default(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(local_server, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert local_server.ephemeral_port_range() == (32768, 60999)


def test_the_choice_does_not_follow_the_random_modules_seed() -> None:
    """Two workers whose global generator an in-process vLLM engine seeded alike (its seed 0) chose the
    same ports for their next servers: the choice comes from the OS's randomness instead."""
    import random

    choices = []
    for _ in range(2):
        random.seed(0)
        choices.append(local_server.free_ports(3))
    assert choices[0] != choices[1]
