"""The served benchmark's passes (benchmarks/served): each pass starts its servers in the other order,
and the figures over two passes keep wave k of every configuration in one round, so the paired
median still compares waves taken seconds apart. The servers and the load are the real benchmark's,
run by hand (docs/performance.md); this checks the bookkeeping that joins the passes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks/ is no package install

from benchmarks.served import load, report, servers


def test_passes_start_the_servers_as_named_then_reversed() -> None:
    names = ["v1_step_process", "v1_step_openai", "vllm_serve_v1"]
    assert servers.start_order(names, 0) == names
    assert servers.start_order(names, 1) == list(reversed(names))
    assert servers.start_order(names, 2) == names


def _wave(tally: load.LevelTally, rate: float, tokens: int = 64) -> None:
    record = load.RequestRecord(sent=0.0, arrivals=[0.1, 0.2], counts=[1, tokens - 1])
    tally.records.append(record)
    tally.wave_rates.append(rate)
    tally.wave_responses.append(rate)
    tally.seconds += tokens / rate


def test_two_passes_pair_round_k_of_each_configuration_and_take_the_best_wave_of_both() -> None:
    ours, theirs = load.new_tally(), load.new_tally()
    for rate_ours, rate_theirs in [(90.0, 100.0), (95.0, 100.0)]:  # pass 1: ours started first, slower
        _wave(ours, rate_ours)
        _wave(theirs, rate_theirs)
    for rate_ours, rate_theirs in [(110.0, 100.0), (112.0, 96.0)]:  # pass 2: theirs started first
        _wave(ours, rate_ours)
        _wave(theirs, rate_theirs)
    mine = load.summarize(ours, 1, 2, 64)
    other = load.summarize(theirs, 1, 2, 64)
    assert mine["tokens_per_s_waves"] == [90.0, 95.0, 110.0, 112.0]
    assert mine["requests"] == 4 and mine["output_tokens"] == 4 * 64 and mine["errors"] == 0
    assert mine["tokens_per_s"] == 112.0 and other["tokens_per_s"] == 100.0
    # rounds 0.90, 0.95, 1.10, 1.1667: the median of the four, not of either pass alone
    assert abs(report.paired_median(mine, other) - (0.95 + 1.10) / 2) < 1e-9
