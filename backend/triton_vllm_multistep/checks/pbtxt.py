"""Reading a model's config.pbtxt string parameters outside Triton (benchmarks, the GPU smoke script).

Owns only that parsing; Triton itself hands the stub the config as JSON, so serving code never
reads config.pbtxt.
"""

from __future__ import annotations

import re

_STRING = r"""("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')"""
_PARAMETER = re.compile(rf"key\s*:\s*{_STRING}\s*value\s*:?\s*\{{\s*string_value\s*:\s*{_STRING}\s*\}}")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def pbtxt_string_parameters(text: str) -> dict[str, str]:
    """The `parameters` string values of a config.pbtxt, without Triton's protobuf classes."""

    def unquote(literal: str) -> str:
        return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), literal[1:-1])

    return {unquote(key): unquote(value) for key, value in _PARAMETER.findall(text)}
