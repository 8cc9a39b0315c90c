"""A `vllm_engine: v1` model's tokenizer for the ensemble's preprocessing stage, in the V1 environment.

The stage's stub runs under Triton's Python environment, whose transformers (4.51) may not load a
tokenizer V1 serves (the e2e tests use a tiny SmolLM3). With config.pbtxt `vllm_engine: v1` the
stage starts this process under the V1 environment's Python (`python -m
triton_vllm_multistep.engine_v1.tokenizer_service FD FOLDER`, stub/v1_tokenizer.py) and asks it, over
the connection, for what its Preprocessor needs of a tokenizer: `encode` and `apply_chat_template`
(as text). Plain values only cross: (method, args, kwargs) in; ("ok", value) or ("error", message)
out.

Owns loading the tokenizer as the V1 engine process's does (transformers' AutoTokenizer of the V1
environment; no torch: it runs no model) and answering until the connection closes (the stub
ended) or the stub dies (the parent's death signal).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

# What the stage's stub may ask of the tokenizer.
METHODS = frozenset({"encode", "apply_chat_template"})
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def serve(connection: Connection, folder: str) -> None:
    """Load the tokenizer (its failure is the first answer), then answer each request in order."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # the stage's load error, in transformers' words
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ok", type(tokenizer).__name__))
    while True:
        try:
            method, args, kwargs = connection.recv()
        except (EOFError, OSError):
            return
        if method not in METHODS:
            connection.send(("error", f"not a tokenizer method this service answers: {method!r}"))
            continue
        try:
            connection.send(("ok", getattr(tokenizer, method)(*args, **kwargs)))
        except Exception as error:  # that request's error (e.g. a model without a chat template)
            connection.send(("error", str(error)))


if __name__ == "__main__":
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the connection's end still ends it
        pass
    # A tokenizer runs no model: transformers would import torch whenever it is installed.
    os.environ["USE_TORCH"] = os.environ["USE_TF"] = os.environ["USE_FLAX"] = "0"
    serve(Connection(int(sys.argv[1])), sys.argv[2])
    sys.exit(0)
