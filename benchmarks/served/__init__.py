"""The served streaming benchmark, split along its seams (entry point: `python -m benchmarks.served_bench`).

- `settings`: the model, the configurations and the targets (read from `targets.toml`: data, not code);
- `offline`: the same engine offline in child processes (the throughput ceilings);
- `servers`: one tritonserver per configuration, their memory and CPU time;
- `load`: the streaming load generator (`tritonclient.grpc.aio`) and per-level figures;
- `report`: ratios, the targets' verdicts, the Markdown table and the chart;
- `cli`: the command line that runs them in order.
Benchmarks print figures; nothing here asserts on timings.
"""
