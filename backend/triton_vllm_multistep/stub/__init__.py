"""Code that runs in the Triton Python backend stub: the entry point (`model.py`, installed as the
backend's model.py), instance wiring (`instance`: settings → engine → response path), request codec, pb_utils tensors
(`triton_io`), the response thread (`responder`), metrics, detokenization windows, device
selection and the ensemble's tokenizer stages.

Nothing here imports vLLM or torch at module level: Triton's auto-complete stub imports this
package, and vLLM/torch would add ~7 s to every model load (checked by tests/unit/test_imports.py).
pb_utils is passed in, never imported (it exists only inside the stub; unit tests pass a fake).
"""
