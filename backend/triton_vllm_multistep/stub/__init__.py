"""Code that runs in the Triton Python backend stub: entry-point wiring, request codec, config,
responses, metrics and the ensemble's tokenizer stages.

Nothing here imports vLLM or torch at module level: Triton's auto-complete stub imports this
package, and vLLM/torch would add ~7 s to every model load (checked by tests/unit/test_imports.py).
"""
