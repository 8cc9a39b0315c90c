"""The instance heartbeat (stub/heartbeat.py) with a fake pb_utils metrics registry: one series per
instance, set to the time at most every HEARTBEAT_SECONDS, only from the thread that owns the calls
into Triton, and deleted on close."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from triton_vllm_multistep.lifecycle.protocol import HEARTBEAT_METRIC, HEARTBEAT_SECONDS
from triton_vllm_multistep.stub.heartbeat import Heartbeat
from triton_vllm_multistep.stub.triton_io import TritonCaller, WrongThreadError


class FakeMetrics:
    """pb_utils.MetricFamily / Metric over a dict: (family name, labels) → value, and what was deleted."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple], float] = {}
        self.sets = 0
        registry = self

        class Metric:
            def __init__(self, family: str, labels: dict[str, str]) -> None:
                self.key = (family, tuple(sorted(labels.items())))

            def set(self, value: float) -> None:
                registry.sets += 1
                registry.values[self.key] = value

            def __del__(self) -> None:
                registry.values.pop(self.key, None)

        class MetricFamily:
            GAUGE = "gauge"

            def __init__(self, name: str, description: str, kind: Any) -> None:
                assert kind == "gauge" and description
                self.name = name

            def Metric(self, labels: dict[str, str]) -> Metric:  # pb_utils' name
                return Metric(self.name, labels)

        self.MetricFamily = MetricFamily


def test_a_beat_sets_the_time_at_most_once_a_period_per_instance() -> None:
    metrics = FakeMetrics()
    before = time.time()
    heartbeat = Heartbeat(metrics, "m", "1", "m_0_0", TritonCaller())
    key = (HEARTBEAT_METRIC, (("instance", "m_0_0"), ("model", "m"), ("version", "1")))
    assert before <= metrics.values[key] <= time.time() and metrics.sets == 1  # the first beat at load
    started = time.monotonic()
    heartbeat.beat(started)
    assert metrics.sets == 1  # not due: the load's beat was less than a period ago
    heartbeat.beat(started + HEARTBEAT_SECONDS)
    heartbeat.beat(started + HEARTBEAT_SECONDS * 1.5)
    assert metrics.sets == 2
    heartbeat.beat(started + HEARTBEAT_SECONDS * 2)
    assert metrics.sets == 3
    heartbeat.close()
    assert key not in metrics.values


def test_only_the_thread_that_owns_the_calls_into_triton_beats() -> None:
    caller = TritonCaller()
    heartbeat = Heartbeat(FakeMetrics(), "m", "1", "m_0_0", caller)
    raised: list[BaseException] = []

    def beat() -> None:
        try:
            heartbeat.beat(time.monotonic() + 10)
        except WrongThreadError as error:
            raised.append(error)

    thread = threading.Thread(target=beat, name="not-the-owner")
    thread.start()
    thread.join()
    assert len(raised) == 1 and "not-the-owner" in str(raised[0])
    with pytest.raises(WrongThreadError):
        caller.hand_to(thread)
        heartbeat.close()
