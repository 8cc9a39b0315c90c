"""How the package's own processes log: the stub and both engine processes write to their stderr,
which is Triton's log, in one format, the package's logger at INFO; the OpenAI servers in theirs.

Owns that format and handler; imports only the standard library (every process loads it, under
either Python). Without it an engine process dropped the package's INFO lines (Python's last-resort
handler shows warnings and errors only), e.g. the model.json fields it ignores.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "triton_vllm_multistep"
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
# The OpenAI servers' lines (their own log, beside vLLM's loggers' handlers): the root logger's format.
SERVER_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def log_server_to_stderr() -> None:
    """An OpenAI server's logging: the root logger in SERVER_LOG_FORMAT, the package's lines at INFO
    (vLLM's serve raises the root logger's level, so the package's logger holds its own)."""
    logging.basicConfig(format=SERVER_LOG_FORMAT)
    logging.getLogger(PACKAGE_LOGGER).setLevel(logging.INFO)


def log_package_to_stderr() -> logging.Logger:
    """The package's logger, writing INFO and above to stderr in LOG_FORMAT (once per process)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
