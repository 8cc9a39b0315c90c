"""config.pbtxt `parameters` as Triton hands them to a model (its config as JSON): read and checked.

Owns ConfigError and the reading of one parameter's text as a boolean, an integer, seconds or
true / false / auto, each bad value an error naming the parameter; must not know what any
parameter means (settings/backend.py does).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """The model configuration is invalid; the message names the file and field."""


def parameter_values(model_config: dict[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters { key: ... value { string_value: ... } }` as a plain dict."""
    return {key: value.get("string_value", "") for key, value in (model_config.get("parameters") or {}).items()}


def config_with_parameters(parameters: dict[str, str]) -> dict[str, Any]:
    """A model config as Triton hands it over, holding only these string parameters (for tools
    that read a config.pbtxt's parameters without Triton)."""
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def as_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"config.pbtxt parameter {name!r} must be true or false, got {text!r}")


def as_int(name: str, text: str, minimum: int = 0, maximum: int | None = None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be <= {maximum}, got {value}")
    return value


def as_seconds(name: str, text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"config.pbtxt parameter {name!r} must be a finite number >= 0, got {text!r}")
    return value


def true_false_or_auto(name: str, text: str) -> bool | None:
    """A true / false / auto config.pbtxt parameter: None for auto."""
    if text.strip().lower() == "auto":
        return None
    try:
        return as_bool(name, text)
    except ConfigError:
        raise ConfigError(f"config.pbtxt parameter {name!r} must be true, false or auto, got {text!r}") from None
