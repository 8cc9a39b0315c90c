"""The report: ratios to the offline ceiling and to steps 1, the targets' verdicts, the table and the chart.

Owns turning measured figures into ratios, verdicts (limits from `targets.toml`), Markdown and a
PNG; must not measure anything.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.served import peers
from benchmarks.served.settings import CONFIGS, DEFAULT_MODEL_REFERENCE, TARGET_CONCURRENCY, TARGETS


def annotate(results: dict[str, Any]) -> None:
    """Ratios to the ceiling and to steps 1, and the targets' verdicts."""
    offline = results["offline"]["llm_generate"]
    ceilings = {c: max(offline[s][c] for s in offline) for c in offline["1"]}
    results["ceiling_tokens_per_s"] = ceilings
    # The offline figure at the thread count the served engines ran with (their log says it; the
    # thread policy follows the model's size), else at the smallest measured.
    by_threads = results["offline"].get("llm_generate_by_threads") or {}
    logged = {config.get("torch_threads") for config in results["served"]} - {None}
    served_threads = str(min(logged) if logged else min(results["offline"].get("torch_threads") or [0]))
    results["served_torch_threads"] = int(served_threads)
    same_threads = {
        c: max(by_threads[s][served_threads][c] for s in by_threads)
        for c in ceilings
        if by_threads and all(served_threads in by_threads[s] for s in by_threads)
    }
    results["ceiling_same_threads_tokens_per_s"] = same_threads
    served = {c["name"]: {lvl["concurrency"]: lvl for lvl in c["levels"]} for c in results["served"]}
    for config in results["served"]:
        for level in config["levels"]:
            c = level["concurrency"]
            ceiling = ceilings.get(str(c))  # none for a level the reused offline run did not measure
            level["vs_ceiling"] = level["tokens_per_s"] / ceiling if ceiling else None
            same = same_threads.get(str(c))
            level["vs_ceiling_same_threads"] = level["tokens_per_s"] / same if same else None
            base = served.get("steps1", {}).get(c)
            level["vs_steps1"] = level["tokens_per_s"] / base["tokens_per_s"] if base else None

    def ratio(name: str, key: str, concurrency: int = TARGET_CONCURRENCY) -> float | None:
        level = served.get(name, {}).get(concurrency)
        return level[key] if level else None

    checks: list[dict[str, Any]] = []

    def check(label: str, value: float | None, limit: float, at_least: bool) -> None:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        checks.append({"target": label, "value": value, "limit": limit, "at_least": at_least, "met": met})

    c = TARGET_CONCURRENCY
    check(
        f"c={c}: steps 8 per step / offline ceiling",
        ratio("steps8_step", "vs_ceiling"),
        TARGETS["steps8_step_vs_ceiling"],
        True,
    )
    check(
        f"c={c}: steps 8 per window / offline ceiling",
        ratio("steps8_window", "vs_ceiling"),
        TARGETS["steps8_window_vs_ceiling"],
        True,
    )
    for name, label in (("steps8_step", "per step"), ("steps8_window", "per window")):
        check(
            f"(info) c={c}: steps 8 {label} / offline at the served thread count",
            ratio(name, "vs_ceiling_same_threads"),
            TARGETS[f"{name}_vs_ceiling"],
            True,
        )
    check(
        f"c={c}: steps 8 per step / steps 1", ratio("steps8_step", "vs_steps1"), TARGETS["steps8_step_vs_steps1"], True
    )
    check(
        f"c={c}: steps 8 per window / steps 1",
        ratio("steps8_window", "vs_steps1"),
        TARGETS["steps8_window_vs_steps1"],
        True,
    )
    # Per step and merge with the engine in the stub, in a process of its own (the default) and in one
    # on CPUs of its own (engine_cpus), each where measured; merge against per window (engine in the
    # stub) of the same run.
    placements = (
        ("", ", engine in the stub"),
        ("_process", ", engine process"),
        ("_pinned", ", engine on CPUs of its own"),
    )
    for suffix, where in placements:
        high = sorted(level for level in served.get(f"steps8_step{suffix}", {}) if level >= c)
        for level in high:
            check(
                f"c={level}: steps 8 per step{where} / offline at the served thread count",
                ratio(f"steps8_step{suffix}", "vs_ceiling_same_threads", level),
                TARGETS["steps8_step_vs_same_threads"],
                True,
            )
        merges = served.get(f"steps8_merge{suffix}", {})
        for level in sorted(level for level in merges if level >= c):
            window = served.get("steps8_window", {}).get(level)
            check(
                f"c={level}: steps 8 merge{where} / steps 8 per window",
                merges[level]["tokens_per_s"] / window["tokens_per_s"] if window else None,
                TARGETS["steps8_merge_vs_window"],
                True,
            )
    for name in [config["name"] for config in results["served"]]:
        level = served.get(name, {}).get(1)
        check(
            f"c=1: TTFT p50 (ms), {CONFIGS[name].label}",
            level["ttft_ms"]["p50"] if level else None,
            TARGETS["ttft_ms_at_1"],
            False,
        )
    step, one = served.get("steps8_step", {}).get(1), served.get("steps1", {}).get(1)
    itl_ratio = step["itl_ms"]["p50"] / one["itl_ms"]["p50"] if step and one else None
    check("c=1: ITL p50 steps 8 per step / steps 1", itl_ratio, TARGETS["itl_step_vs_steps1_at_1"], False)
    for suffix, where in placements:
        merge, per_step = served.get(f"steps8_merge{suffix}", {}).get(1), served.get(f"steps8_step{suffix}", {}).get(1)
        if merge or not suffix:
            merge_itl = merge["itl_ms"]["p50"] / per_step["itl_ms"]["p50"] if merge and per_step else None
            check(f"c=1: ITL p50 steps 8 merge / per step{where}", merge_itl, TARGETS["itl_merge_vs_step_at_1"], False)
    peer_checks(served, results.get("model") == DEFAULT_MODEL_REFERENCE, check)
    openai_checks(served, check)
    v1_checks(served, check)
    for config in results["served"]:
        check(f"start to READY (s), {config['label']}", config["ready_seconds"], TARGETS["ready_seconds"], False)
        check(
            f"idle RSS of server processes (GB), {config['label']}",
            config["idle_memory"]["rss_gb"],
            TARGETS["idle_memory_gb"],
            False,
        )
    results["targets"] = checks


# Our configurations compared with each peer: per step as shipped (the engine in a process of its
# own; with the engine in the stub where that was not measured) against the targets, the others
# as information.
PER_STEP = ("steps8_step_process", "steps8_step")
COMPARED_WITH_PEERS = (*PER_STEP, "steps8_merge_process", "steps8_merge", "steps8_window")


def openai_checks(served: dict[str, dict[int, dict[str, Any]]], check: Any) -> None:
    """The OpenAI API path (steps8_step_openai) over KServe gRPC (steps8_step_process) and over
    `vllm serve` (vllm_serve), at every level measured in the same run, against targets.toml."""
    ours = served.get("steps8_step_openai", {})
    for other, target in (("steps8_step_process", "openai_vs_kserve"), ("vllm_serve", "openai_vs_vllm_serve")):
        for level in sorted(set(ours) & set(served.get(other, {}))):
            value = ours[level]["tokens_per_s"] / served[other][level]["tokens_per_s"]
            label = f"c={level}: {CONFIGS['steps8_step_openai'].label} / {CONFIGS[other].label}"
            check(label, value, TARGETS[target], True)


# Our V1 models (vllm_engine v1) over `vllm serve` of the same V1 engine: through KServe gRPC and
# through the project's OpenAI API.
V1_OVER_VLLM_SERVE_V1 = ("v1_step_process", "v1_step_openai")


def paired_median(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """The median over rounds of ours' wave / theirs' wave of the same round (load.run_level runs
    wave k of every configuration back to back): a ratio a shared host's drift between rounds does not
    move, and one lucky wave does not make, as it can the ratio of best waves."""
    pairs = [a / b for a, b in zip(ours["tokens_per_s_waves"], theirs["tokens_per_s_waves"], strict=False) if b]
    return statistics.median(pairs) if pairs else None


def v1_checks(served: dict[str, dict[int, dict[str, Any]]], check: Any) -> None:
    """A V1 model through this backend over vLLM's own OpenAI server of the same engine (vllm_serve_v1),
    at every level measured in the same run (issue #32: at least 1.0x), and the same as the median of
    the rounds' ratios (information); the multi-step per-step configurations over it as information."""
    theirs = served.get("vllm_serve_v1", {})
    extra = ["v1_step_process_async", "v1_step_process_inproc", "v1_step_process_pinned"]
    for name in [*V1_OVER_VLLM_SERVE_V1, *extra, *PER_STEP, "steps1"]:
        for level in sorted(set(served.get(name, {})) & set(theirs)):
            value = served[name][level]["tokens_per_s"] / theirs[level]["tokens_per_s"]
            label = f"c={level}: {CONFIGS[name].label} / {CONFIGS['vllm_serve_v1'].label}"
            if name in V1_OVER_VLLM_SERVE_V1:
                check(label, value, TARGETS["v1_vs_vllm_serve_v1"], True)
                rounds = len(served[name][level]["tokens_per_s_waves"])
                median = paired_median(served[name][level], theirs[level])
                check(f"(info) {label}, median of {rounds} rounds' ratios", median, 1.0, True)
            else:
                check("(info) " + label, value, 1.0, True)


def peer_checks(
    served: dict[str, dict[int, dict[str, Any]]],
    demo_model: bool,
    check: Any,
) -> None:
    """Per step over each peer measured in the same run, against targets.toml's limits; every other
    configuration of ours as information."""
    from_level = int(TARGETS["peer_from_concurrency"])
    shipped = next((name for name in PER_STEP if name in served), None)
    for peer in [name for name in served if CONFIGS[name].server in peers.PEER_KINDS]:
        for level in sorted(served[peer]):
            theirs = served[peer][level]["tokens_per_s"]
            if shipped is not None and level in served[shipped]:
                if CONFIGS[peer].server == peers.VLLM_SERVE:
                    limit = TARGETS["steps8_step_vs_vllm_serve"]
                elif CONFIGS[peer].server == peers.VLLM_SERVE_V1:
                    limit = None  # another engine: information (the V1 targets are v1_checks')
                elif demo_model:
                    limit = TARGETS["steps8_step_vs_triton_vllm_backend"] if level >= from_level else None
                elif level == TARGET_CONCURRENCY:
                    limit = TARGETS["steps8_step_vs_triton_vllm_backend_real_at_target"]
                else:
                    limit = TARGETS["steps8_step_vs_triton_vllm_backend_real"]
                label = f"c={level}: {CONFIGS[shipped].label} / {CONFIGS[peer].label}"
                value = served[shipped][level]["tokens_per_s"] / theirs
                check(label if limit is not None else "(info) " + label, value, limit or 1.0, True)
            for name in COMPARED_WITH_PEERS:
                if name != shipped and level in served.get(name, {}):
                    ratio = served[name][level]["tokens_per_s"] / theirs
                    check(f"(info) c={level}: {CONFIGS[name].label} / {CONFIGS[peer].label}", ratio, 1.0, True)


def format_table(results: dict[str, Any]) -> str:
    lines = []
    offline = results["offline"]
    header = (
        "| configuration | streams | tok/s | vs ceiling (same threads) | vs steps 1 | resp/s | TTFT p50/p90/p99 ms "
        "| ITL p50/p90/p99 ms | errors | CPU s/1k tok server/stub/engine process/client |"
    )
    lines.append(header)
    lines.append("|" + "---|" * 10)
    concurrencies = list(offline["llm_generate"]["1"])
    for steps in sorted(offline["llm_generate"]):
        for c in concurrencies:
            value = offline["llm_generate"][steps][c]
            lines.append(
                f"| offline LLM.generate, steps {steps} | {c} | {value:.0f} | "
                f"{value / results['ceiling_tokens_per_s'][c]:.2f} | | | | | | |"
            )
    for c in concurrencies:
        lines.append(f"| forward-only ceiling | {c} | {offline['forward_only'][c]:.0f} | | | | | | | |")

    def fmt(p: dict[str, float | None], digits: int) -> str:
        return "/".join("-" if p[k] is None else f"{p[k]:.{digits}f}" for k in ("p50", "p90", "p99"))

    for config in results["served"]:
        for level in config["levels"]:
            cpu = level["cpu_s_per_1k_tokens"]
            vs1 = "" if level["vs_steps1"] is None else f"{level['vs_steps1']:.2f}"
            same = level.get("vs_ceiling_same_threads")
            vs_ceiling = "-" if level["vs_ceiling"] is None else f"{level['vs_ceiling']:.2f}"
            vs_ceiling += "" if same is None else f" ({same:.2f})"
            lines.append(
                f"| {config['label']} | {level['concurrency']} | {level['tokens_per_s']:.0f} | "
                f"{vs_ceiling} | {vs1} | {level['responses_per_s']:.0f} | "
                f"{fmt(level['ttft_ms'], 1)} | {fmt(level['itl_ms'], 2)} | {level['errors']} | "
                f"{cpu['tritonserver']:.3f}/{cpu['stub']:.3f}/{cpu.get('engine', 0.0):.3f}/{cpu['client']:.3f} |"
            )
    lines.append("")
    lines.append("| configuration | start to READY s | idle RSS GB (PSS GB) |")
    lines.append("|---|---|---|")
    for config in results["served"]:
        memory = config["idle_memory"]
        lines.append(
            f"| {config['label']} | {config['ready_seconds']:.1f} | {memory['rss_gb']:.2f} ({memory['pss_gb']:.2f}) |"
        )
    lines.append("")
    lines.append("| target | value | limit | met |")
    lines.append("|---|---|---|---|")
    for check in results["targets"]:
        value = "-" if check["value"] is None else f"{check['value']:.3g}"
        sign = "≥" if check["at_least"] else "≤"
        met = {True: "yes", False: "NO", None: "not run"}[check["met"]]
        lines.append(f"| {check['target']} | {value} | {sign} {check['limit']} | {met} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    offline = results["offline"]
    concurrencies = [int(c) for c in offline["llm_generate"]["1"]]
    ax = axes[0]
    for steps, figures in sorted(offline["llm_generate"].items()):
        ax.plot(
            concurrencies,
            [figures[str(c)] for c in concurrencies],
            "k--" if steps == "8" else "k:",
            label=f"offline LLM.generate, steps {steps}",
        )
    served_threads = str(min(offline.get("torch_threads") or [0]))
    same_threads = (offline.get("llm_generate_by_threads") or {}).get("8", {}).get(served_threads)
    if same_threads:
        ax.plot(
            concurrencies,
            [same_threads[str(c)] for c in concurrencies],
            color="tab:purple",
            linestyle="--",
            label=f"offline LLM.generate, steps 8, at the served torch threads ({served_threads})",
        )
    ax.plot(
        concurrencies,
        [offline["forward_only"][str(c)] for c in concurrencies],
        color="grey",
        linestyle="-.",
        label="forward-only ceiling",
    )
    for config in results["served"]:
        xs = [lvl["concurrency"] for lvl in config["levels"]]
        axes[0].plot(xs, [lvl["tokens_per_s"] for lvl in config["levels"]], "o-", label=config["label"])
        axes[1].plot(xs, [lvl["ttft_ms"]["p50"] for lvl in config["levels"]], "o-", label=config["label"])
        axes[2].plot(xs, [lvl["itl_ms"]["p50"] for lvl in config["levels"]], "o-", label=config["label"])
    titles = ("output tokens/s", "time to first token p50 (ms)", "inter-token latency p50 (ms)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrent streams")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{results['model']}, {results['max_tokens']} tokens per request, greedy, ignore_eos; "
        f"{results['cpu_count']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_prefix_table(results: dict[str, Any]) -> str:
    """The shared-prefix run: time to first token and throughput with prefix caching off and on."""
    lines = [
        f"Every prompt starts with the same {results['shared_prefix_tokens']}-token system prompt; "
        f"{results['max_tokens']} tokens out, greedy.",
        "",
        "| configuration | streams | TTFT p50/p90 ms | tok/s | ITL p50 ms |",
        "|---|---|---|---|---|",
    ]
    by_name = {config["name"]: {lvl["concurrency"]: lvl for lvl in config["levels"]} for config in results["served"]}
    for config in results["served"]:
        for level in config["levels"]:
            ttft = level["ttft_ms"]
            lines.append(
                f"| {config['label']} | {level['concurrency']} | {ttft['p50']:.1f}/{ttft['p90']:.1f} | "
                f"{level['tokens_per_s']:.0f} | {level['itl_ms']['p50']:.2f} |"
            )
    lines += ["", "| streams | TTFT p50 on / off | tok/s on / off |", "|---|---|---|"]
    for concurrency, off in by_name.get("prefix_off", {}).items():
        on = by_name.get("prefix_on", {}).get(concurrency)
        if on:
            lines.append(
                f"| {concurrency} | {on['ttft_ms']['p50'] / off['ttft_ms']['p50']:.2f} | "
                f"{on['tokens_per_s'] / off['tokens_per_s']:.2f} |"
            )
    return "\n".join(lines)
