"""Flat dataclass configs loaded from YAML, with `key=value` overrides from the command line.

Every long job (datagen, training, sweeps) takes its settings from one of these. Unknown keys
are refused with the list of valid ones, because a silently ignored typo in a config costs a
whole run.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import UserError

T = TypeVar("T")


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML/CLI value to the field's declared type where that is unambiguous."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        return None
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        non_none = [a for a in args if a is not type(None)]
        return _coerce(name, value, non_none[0]) if len(non_none) == 1 else value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        return [_coerce(name, v, inner) for v in value]
    try:
        if tp is bool and isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if tp in (int, float, str, bool):
            if tp is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return tp(value)
    except (TypeError, ValueError):
        raise UserError(f"config key '{name}' must be of type {tp.__name__}, got {value!r}") from None
    return value


def config_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def config_help(cls: type) -> str:
    """Every key of `cls` with its default, for --help: the config file and key=value take these."""
    lines = [f"config keys (YAML or key=value; default in brackets) of {cls.__name__}:"]
    lines += [f"  {f.name} [{_default(f)!r}]" for f in dataclasses.fields(cls)]
    return "\n".join(lines)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from a YAML file (optional) and `key=value` overrides (applied last)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist; pass an existing YAML file to --config")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must hold a mapping of key: value pairs")
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        raw[key.strip()] = yaml.safe_load(value) if value != "" else ""
    valid = config_keys(cls)
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise UserError(
            f"unknown config key(s) {', '.join(repr(k) for k in unknown)} for {cls.__name__}; "
            f"valid keys: {', '.join(valid)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in raw.items()}
    missing = [
        f.name for f in dataclasses.fields(cls)
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise UserError(f"config is missing required key(s): {', '.join(missing)}")
    cfg = cls(**kwargs)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_argv(cls: type[T], argv, prog: str, description: str, default_name: str) -> T:
    """`--config FILE key=value ...` -> a loaded `cls`; an empty `name` becomes the file's stem.

    The shared command line of the long jobs (datagen, sweep): one YAML file, overrides last.
    """
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=config_help(cls),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"YAML file of {cls.__name__} keys (listed below)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
    args = parser.parse_args(argv)
    cfg = load_config(cls, args.config, args.overrides)
    if not cfg.name:
        cfg.name = Path(args.config).stem if args.config else default_name
    return cfg
