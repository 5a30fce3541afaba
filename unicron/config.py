"""Service configuration: frozen dataclasses filled with one precedence order,
command-line flags > environment variables > config file (YAML) > defaults.

A field `heartbeat_timeout_s` of a config with prefix UNICRON_COORDINATOR is set by
`--heartbeat-timeout-s`, then `UNICRON_COORDINATOR_HEARTBEAT_TIMEOUT_S`, then the
`heartbeat_timeout_s` key of the file named by `--config` (or `<PREFIX>_CONFIG`). A field
declared with ``setting(default, help)`` says in ``--help`` what it does, its default and its
environment variable.

YAML (config files here, job specs in unicron.jobspec) is read by ``load_yaml``: YAML 1.1 as
PyYAML reads it, except that numbers written as YAML 1.2 writes them (``1e9``, ``1.0e9``)
are numbers too, not strings.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from unicron.errors import InvalidArgument

C = TypeVar("C")
T = TypeVar("T")


def setting(default: T, help: str) -> T:
    """A config field with its help text: what it does, and what an empty or special value
    means. ``load_config`` adds the default and the environment variable."""
    return typing.cast(T, dataclasses.field(default=default, metadata={"help": help}))


class YAMLFloat(float):
    """A float read from YAML that keeps the text it was written as, so that where a string
    is expected (an environment value, an argument, a name) ``str`` gives that text: ``1e-3``
    stays ``1e-3``, and ``3e4567`` (a commit hash, say) is not an overflowed infinity."""

    text: str

    def __str__(self) -> str:
        return getattr(self, "text", float.__repr__(self))

    __repr__ = __str__


class YAMLLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's floats: YAML 1.1 wants a dot and a signed
    exponent (``1.0e+9``), and reads ``1e9`` or ``1.0e9`` as a string."""


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    number = YAMLFloat(loader.construct_yaml_float(node))
    number.text = str(node.value)
    return number


YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
YAMLLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def load_yaml(text: str) -> Any:
    """One YAML document, read with YAMLLoader; raises yaml.YAMLError."""
    return yaml.load(text, Loader=YAMLLoader)  # a SafeLoader: builds no objects but plain data


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
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError(raw)  # int() would truncate it
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


def help_text(field: dataclasses.Field[Any], env_prefix: str) -> str:
    """A setting's ``--help`` line: what it does (its ``setting`` help), its default and its
    environment variable."""
    said = str(field.metadata.get("help", "")).strip()
    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    where = f"default {_shown(default)}; env {env_prefix}_{field.name.upper()}"
    text = f"{said} ({where})" if said else where
    return text.replace("%", "%%")  # argparse formats help with %


def _shown(default: Any) -> str:
    if default is dataclasses.MISSING:
        return "none: required"
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, (tuple, list)):
        default = ",".join(str(item) for item in default)
    if isinstance(default, float):
        short = f"{default:g}"
        return short if float(short) == default else repr(default)
    return str(default) if default != "" else "empty"


def program_name() -> str:
    """How the running program was started, for usage lines: `python -m services.agent`
    rather than argparse's `__main__.py`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return f"python -m {module}"
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "unicron"


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
    parser = argparse.ArgumentParser(prog=program_name(), description=description)
    parser.add_argument(
        "--config",
        help=f"a YAML file of settings, keyed by the names below with underscores; flags and environment "
        f"variables override it (env {env_prefix}_CONFIG)",
    )
    for field in fields:
        kind = _field_type(cls, field)
        flag = "--" + field.name.replace("_", "-")
        action: str | type[argparse.Action] = argparse.BooleanOptionalAction if kind is bool else "store"
        parser.add_argument(flag, dest=field.name, default=None, action=action, help=help_text(field, env_prefix))
    args = parser.parse_args(list(argv) if argv is not None else [])

    values: dict[str, Any] = {}
    config_path = args.config or env.get(f"{env_prefix}_CONFIG")
    if config_path:
        try:
            loaded = load_yaml(Path(config_path).read_text()) or {}
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
