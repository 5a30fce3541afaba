"""Service configuration: frozen dataclasses filled with one precedence order,
command-line flags > environment variables > config file (YAML) > defaults.

A field `heartbeat_timeout_s` of a config with prefix UNICRON_COORDINATOR is set by
`--heartbeat-timeout-s`, then `UNICRON_COORDINATOR_HEARTBEAT_TIMEOUT_S`, then the
`heartbeat_timeout_s` key of the file named by `--config` (or `<PREFIX>_CONFIG`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from unicron.errors import InvalidArgument

C = TypeVar("C")


def _field_type(cls: type, field: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    hint = hints[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return tuple
    return typing.cast(type, hint)


def _convert(kind: type, raw: Any, name: str) -> Any:
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            lowered = str(raw).strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is tuple:
            items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
            return tuple(str(item).strip() for item in items if str(item).strip())
        return kind(raw)
    except (TypeError, ValueError):
        raise InvalidArgument(name, f"cannot read {raw!r} as {kind.__name__}") from None


def to_env(cls: type, env_prefix: str, values: Mapping[str, object]) -> dict[str, str]:
    """The environment variables that make ``load_config(cls, env_prefix)`` read ``values``
    (field name -> value): booleans as 1/0, tuples comma-joined, None left out."""
    names = {field.name for field in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"{cls.__name__} has no setting {name!r}")
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (tuple, list)):
            text = ",".join(str(item) for item in value)
        else:
            text = str(value)
        out[f"{env_prefix}_{name.upper()}"] = text
    return out


def load_config(
    cls: type[C],
    *,
    env_prefix: str,
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    description: str = "",
) -> C:
    """Builds `cls` from flags, environment, file and defaults; raises InvalidArgument."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    env = os.environ if env is None else env
    fields = dataclasses.fields(cls)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help=f"YAML config file (env {env_prefix}_CONFIG)")
    for field in fields:
        kind = _field_type(cls, field)
        flag = "--" + field.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=field.name, default=None, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=field.name, default=None, help=f"env {env_prefix}_{field.name.upper()}")
    args = parser.parse_args(list(argv) if argv is not None else [])

    values: dict[str, Any] = {}
    config_path = args.config or env.get(f"{env_prefix}_CONFIG")
    if config_path:
        try:
            loaded = yaml.safe_load(Path(config_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidArgument("config", f"cannot read {config_path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise InvalidArgument("config", f"{config_path} must hold a mapping")
        known = {f.name for f in fields}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise InvalidArgument(f"config.{unknown[0]}", "unknown setting")
        values.update(loaded)
    for field in fields:
        env_value = env.get(f"{env_prefix}_{field.name.upper()}")
        if env_value is not None:
            values[field.name] = env_value
        flag_value = getattr(args, field.name)
        if flag_value is not None:
            values[field.name] = flag_value
    converted = {
        name: _convert(_field_type(cls, next(f for f in fields if f.name == name)), raw, name)
        for name, raw in values.items()
    }
    try:
        return cls(**converted)
    except ValueError as exc:
        raise InvalidArgument("config", str(exc)) from None


def require(condition: bool, field: str, problem: str) -> None:
    """For config __post_init__ checks: one readable error naming the field."""
    if not condition:
        raise InvalidArgument(field, problem)
