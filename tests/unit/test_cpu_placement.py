"""engine_cpus: CPU lists, the checks against the host and the user's thread settings, and pinning
every thread of a process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.settings import ConfigError
from triton_vllm_multistep.stub import instance


@pytest.mark.parametrize(
    ("text", "cpus", "canonical"),
    [("1", (1,), "1"), ("0-3", (0, 1, 2, 3), "0-3"), ("3,0-1, 5", (0, 1, 3, 5), "0-1,3,5"), ("2,2", (2,), "2")],
)
def test_cpu_lists_parse_and_print_as_linux_writes_them(text: str, cpus: tuple[int, ...], canonical: str) -> None:
    assert cpu_placement.parse_cpu_list(text) == cpus
    assert cpu_placement.cpu_list_text(cpus) == canonical


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "4-2", "1;2", "1.5"])
def test_what_is_not_a_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(cpu_placement.CpuListError, match="is not a CPU list"):
        cpu_placement.parse_cpu_list(text)


def test_cpus_the_host_has_not_are_refused_naming_them() -> None:
    beyond = 4095  # no CPU this host has
    if os.path.exists(f"/sys/devices/system/cpu/cpu{beyond}"):
        pytest.skip("this host has a CPU 4095")
    assert cpu_placement.placement_refusal((beyond,)) == "sched_setaffinity: Invalid argument"
    now = cpu_placement.cpu_list_text(cpu_placement.allowed_cpus())
    message = f"engine_cpus {beyond} names CPUs this server may not run on .*CPUs it runs on now: {now}"
    with pytest.raises(cpu_placement.CpuListError, match=message):
        cpu_placement.check_engine_cpus((beyond,), {})


def test_the_probe_moves_nothing_and_allows_cpus_beyond_a_narrowed_affinity() -> None:
    """A server started with taskset (its affinity narrower than its cpuset) may still give its
    engine the CPUs it is not on: probed in a process narrowed to its first CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    script = f"""
import os
from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.settings import ConfigError
os.sched_setaffinity(0, {{{cpus[0]}}})
print(cpu_placement.placement_refusal(({cpus[-1]},)), sorted(os.sched_getaffinity(0)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.split(maxsplit=1) == ["None", f"[{cpus[0]}]\n"]


# The checks below run on this host's CPUs (the probe accepts them).
CPUS = cpu_placement.allowed_cpus()
CPU_LIST = cpu_placement.cpu_list_text(CPUS)


@pytest.mark.parametrize(
    ("user_threads", "message"),
    [
        ({"VLLM_CPU_OMP_THREADS_BIND": "4095"}, f"{CPU_LIST} disagrees with VLLM_CPU_OMP_THREADS_BIND=4095"),
        ({"OMP_NUM_THREADS": "64"}, f"{CPU_LIST} runs {len(CPUS)} torch thread\\(s\\) but OMP_NUM_THREADS=64"),
    ],
)
def test_a_thread_setting_of_the_user_that_disagrees_is_refused_naming_both(user_threads: dict, message: str) -> None:
    with pytest.raises(cpu_placement.CpuListError, match=message):
        cpu_placement.check_engine_cpus(CPUS, user_threads)


@pytest.mark.parametrize(
    "user_threads",
    [
        {},
        {"VLLM_CPU_OMP_THREADS_BIND": "all"},
        {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in reversed(CPUS))},
        {"OMP_NUM_THREADS": str(len(CPUS))},
    ],
)
def test_thread_settings_that_agree_pass(user_threads: dict) -> None:
    cpu_placement.check_engine_cpus(CPUS, user_threads)


def test_the_engine_gets_vllms_own_binding_for_its_cpus() -> None:
    assert cpu_placement.engine_thread_environment((0, 2, 3)) == {"VLLM_CPU_OMP_THREADS_BIND": "0,2-3"}


def test_pin_process_moves_threads_already_running_and_those_started_later() -> None:
    cpu = min(os.sched_getaffinity(0))
    script = f"""
import json, os, threading
from triton_vllm_multistep.engine import cpu_placement
from triton_vllm_multistep.settings import ConfigError
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
cpu_placement.pin_process([{cpu}])
after = threading.Thread(target=stop.wait)
after.start()
placements = cpu_placement.thread_cpus(os.getpid())
print(json.dumps(sorted(set(placements.values()))), len(placements))
stop.set()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    placements, threads = result.stdout.split()
    assert json.loads(placements) == [[cpu]] and int(threads) == 3


def test_one_placement_for_several_instances_is_a_load_error_naming_both(monkeypatch) -> None:
    model_config = {"instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    with pytest.raises(ConfigError, match="engine_cpus places one engine, but instance_group runs 2"):
        instance.place_engine((0,), model_config, {}, "llm", engine_on_cpu=True)


def test_the_placement_checks_reach_the_load_error(monkeypatch) -> None:
    model_config = {"instance_group": [{"kind": "KIND_CPU", "count": 1}]}
    allowed = cpu_placement.cpu_list_text(cpu_placement.allowed_cpus())
    beyond = 4095  # no CPU this host has
    message = f"model llm: engine_cpus {beyond} names CPUs this server may not run on .*{allowed}"
    with pytest.raises(ConfigError, match=message):
        instance.place_engine((beyond,), model_config, {}, "llm", engine_on_cpu=True)


def test_engine_cpus_holding_every_cpu_of_the_stub_leave_its_threads_where_they_are(caplog, monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger("triton_vllm_multistep"), "propagate", True)  # the stub's logger
    model_config = {"instance_group": [{"kind": "KIND_CPU", "count": 1}]}
    assert set(cpu_placement.thread_cpus(os.getpid()).values()) == {CPUS}
    with caplog.at_level(logging.WARNING, logger="triton_vllm_multistep"):
        instance.place_engine(CPUS, model_config, {}, "llm", engine_on_cpu=True)
    assert set(cpu_placement.thread_cpus(os.getpid()).values()) == {CPUS}  # nothing moved
    assert f"engine_cpus {CPU_LIST} hold every CPU the stub runs on: its threads share them" in caplog.text


def test_where_vllm_binds_no_threads_the_users_thread_settings_stand() -> None:
    """GPU workers ignore VLLM_CPU_OMP_THREADS_BIND (only vllm/worker/cpu_worker.py reads it), so
    there OMP_NUM_THREADS is not a disagreement; the placement itself is still checked."""
    cpu_placement.check_engine_cpus(CPUS, {"OMP_NUM_THREADS": "64"}, threads_bound=False)
    with pytest.raises(cpu_placement.CpuListError, match="names CPUs this server may not run on"):
        cpu_placement.check_engine_cpus((4095,), {}, threads_bound=False)
