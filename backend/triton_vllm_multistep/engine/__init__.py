"""Code that drives vLLM: building the engine (`factory`; GPU: vLLM's MultiStepWorker, CPU: our
runner in `cpu_multistep`) and the engine thread (`loop`), the only caller of `step()`.

Knows nothing of Triton (import-linter forbids stub, lifecycle and host); `events` is the
boundary the stub reads (step outputs, failures, the stream mode) and imports no vLLM.
"""
