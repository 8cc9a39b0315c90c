"""The drain protocol, the heartbeat's name, and every timing constant of the Triton 2.51 shutdown
and health workarounds.

Owns the drain file's format (who writes what, where), the messages clients see and the
timings; must hold no logic beyond naming files. Model side: `drain`; host side: `server_drain`
(used by the launcher and `triton-vllm-multistep drain`). See docs/lifecycle.md.

Protocol: the host appends a line holding tritonserver's pid to the file named by
DRAIN_FILE_ENV (in the server's environment); every instance of this backend in that server
drains (intake closed, requests in flight finish or end with DRAIN_REQUESTED_MESSAGE) and then
writes `drained_marker(...)` holding how many requests it had. Lines and markers older than the
process that reads them are leftovers (a restarted container keeps /tmp; PIDs repeat).
"""

from __future__ import annotations

from pathlib import Path

DRAIN_FILE_ENV = "TRITON_VLLM_MULTISTEP_DRAIN_FILE"

# What a request ended by a drain is told (Triton error code UNAVAILABLE).
UNLOADING_MESSAGE = "the model is being unloaded (or the server is stopping)"
DRAIN_REQUESTED_MESSAGE = "the server is about to stop"

# Triton's own default for --exit-timeout-secs (tritonserver 2.51).
TRITON_DEFAULT_EXIT_TIMEOUT = 30.0
# Left of the exit timeout for ending the remaining streams, finalize (engine shutdown) and
# Triton's own unloading.
DRAIN_MARGIN_SECONDS = 5.0
# After the last LLM FINAL, an ensemble still runs its postprocessing step on it: give it this
# long before the server is told to stop (it then refuses new composing-model requests).
SETTLE_SECONDS = 1.0
# After SIGINT/SIGTERM, tritonserver gets its --exit-timeout-secs plus this before the launcher
# kills it: when the exit timeout expires with a Python backend still busy, tritonserver 2.51 can
# crash in its exit path and hang there instead of exiting.
EXIT_GRACE_SECONDS = 15.0
# Ending requests on a drain: between aborting them and sending their errors, so that a Triton
# 2.51 ensemble still postprocessing an earlier response can finish it first (it never finishes a
# request whose error arrives meanwhile).
ENSEMBLE_CATCH_UP_SECONDS = 0.2
# Readiness probe of a busy instance (over the server's HTTP endpoint), and while waiting for the
# endpoint's first answer.
READINESS_POLL_SECONDS = 0.25
READINESS_FIRST_ANSWER_POLL_SECONDS = 0.02
# File mtimes and /proc start times have clock-tick resolution.
CLOCK_SLACK_SECONDS = 1.0
# The instances' heartbeat (stub/heartbeat.py sets it, host/probe.py reads its age): what the
# Python backend's health endpoints cannot show, an instance alive but stuck. Set every
# HEARTBEAT_SECONDS by the response thread; older than HEARTBEAT_STALE_SECONDS (a few beats: a
# beat can wait behind one engine step's responses) is stuck, within the readiness probe's period.
HEARTBEAT_METRIC = "vllm_multistep:heartbeat_timestamp_seconds"
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_STALE_SECONDS = 4.0


def drained_marker(drain_file: Path, stub_pid: int) -> Path:
    """The file a model instance (its stub process) creates once it has drained on request."""
    return drain_file.with_name(f"{drain_file.name}.drained.{stub_pid}")


def request_drain(drain_file: Path, server_pid: int) -> None:
    """Ask the instances of tritonserver `server_pid` that watch `drain_file` to drain."""
    drain_file.parent.mkdir(parents=True, exist_ok=True)
    with drain_file.open("a") as requests:
        requests.write(f"{server_pid}\n")
