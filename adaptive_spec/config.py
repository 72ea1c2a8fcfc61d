"""Flat dataclass configs loaded from YAML, with `key=value` overrides from the command line.

pydantic converts and checks each value against the field's type (as params.py does for the
pair and the policies); this module adds the YAML file, the overrides and the one-line errors.

Every long job (datagen, training, sweeps) takes its settings from one of these. Unknown keys
are refused with the list of valid ones, because a silently ignored typo in a config costs a
whole run.

A field typed as a params.py class (the model pair's `pair: PairParams`) is a YAML mapping checked
by that class, as `generate` checks its flags; `pair.draft=...` overrides one of its keys.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

from .errors import UserError
from .typed import Params, build

T = TypeVar("T")


def _validate(cls: type[T], raw: dict[str, Any]) -> T:
    """pydantic converts each value to its field's declared type (lax: "4" -> 4, "true" -> True, one
    value -> a one-element list) or names the key that does not fit, in one line."""
    hints = typing.get_type_hints(cls)
    # YAML reads `name: 7` as a number; a field of type str takes it as text
    raw = {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and hints[k] in (str, str | None)
           else v for k, v in raw.items()}
    try:
        return TypeAdapter(cls).validate_python(raw)
    except ValidationError as e:
        errors = e.errors()
        missing = [str(x["loc"][0]) for x in errors if x["type"] == "missing"]
        if missing:
            raise UserError(f"config is missing required key(s): {', '.join(missing)}") from None
        first = errors[0]
        key = first["loc"][0] if first["loc"] else "?"
        hint = hints.get(key, Any)
        if typing.get_origin(hint) is typing.Literal:
            raise UserError(f"config key '{key}' must be one of {', '.join(map(str, typing.get_args(hint)))}, "
                            f"got {first['input']!r}") from None
        raise UserError(f"config key '{key}' must be of type {getattr(hint, '__name__', str(hint))}, got "
                        f"{first['input']!r} ({first['msg'].lower()})") from None


def _is_list(cls: type, key: str) -> bool:
    return typing.get_origin(typing.get_type_hints(cls)[key]) in (list, tuple)


def config_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def params_fields(cls: type) -> dict[str, type[Params]]:
    """The fields of `cls` that hold a params.py class (e.g. pair: PairParams), by name."""
    hints = typing.get_type_hints(cls)
    return {k: t for k, t in hints.items() if isinstance(t, type) and issubclass(t, Params)}


def _nest_dotted(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """`pair.draft: x` (a key=value override, or a YAML key) into the `pair` mapping, in order."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        outer, _, inner = key.partition(".")
        if not (inner and outer in params_fields(cls)):
            out[key] = value
        elif isinstance(out.get(outer) or {}, dict):
            out[outer] = {**(out.get(outer) or {}), inner: value}
        else:
            raise UserError(f"config key {key!r}: '{outer}' is not a mapping, got {out[outer]!r}")
    return out


def _build_params(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """Each params field's mapping built by its class: an unknown or bad key gets that class's one-line
    error, spelled as the YAML has it (pair.draft_quant)."""
    for name, pcls in params_fields(cls).items():
        value = raw.get(name)
        if value is None or isinstance(value, Params):
            continue
        if not isinstance(value, dict):
            raise UserError(f"config key '{name}' must be a mapping of its settings, e.g. {name}: "
                            f"{{{next(iter(pcls.model_fields))}: ...}}, got {value!r}")
        raw[name] = build(pcls, value, f"'{name}'", spell=lambda key, name=name: f"{name}.{key}")
    return raw


def _unknown_keys(cls: type, unknown: list[str]) -> UserError:
    """The refusal of keys `cls` does not have: where one is a setting of a nested section (`pair:`), where
    to write it; then the valid keys."""
    where = ""
    for name, pcls in params_fields(cls).items():
        nested = [k for k in unknown if k in pcls.model_fields]
        if nested:
            where += (f"; {', '.join(nested)} {'is a' if len(nested) == 1 else 'are'} {name} setting"
                      f"{'s' if len(nested) > 1 else ''}: write {name}: {{{nested[0]}: ...}}, or "
                      f"{name}.{nested[0]}=... on the command line")
    return UserError(f"unknown config key(s) {', '.join(repr(k) for k in unknown)} for {cls.__name__}{where}; "
                     f"valid keys: {', '.join(config_keys(cls))}")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def config_help(cls: type) -> str:
    """Every key of `cls` with its default, for --help: the config file and key=value take these."""
    lines = [f"config keys (YAML or key=value; default in brackets) of {cls.__name__}:"]
    nested = params_fields(cls)
    for f in dataclasses.fields(cls):
        if f.name in nested:  # one line per setting of the mapping: pair.draft [...]
            lines += [f"  {f.name}.{k} [{v.default!r}]" for k, v in nested[f.name].model_fields.items()]
        else:
            lines.append(f"  {f.name} [{_default(f)!r}]")
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
    raw = _nest_dotted(cls, raw)
    valid = config_keys(cls)
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise _unknown_keys(cls, unknown)
    raw = {k: ([v] if _is_list(cls, k) and not isinstance(v, (list, tuple)) else v) for k, v in raw.items()}
    cfg = _validate(cls, _build_params(cls, raw))
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (JSON), a params field as the mapping the YAML takes."""
    return {k: v.model_dump() if isinstance(v, Params) else v for k, v in dataclasses.asdict(cfg).items()}


def config_from_argv(cls: type[T], argv, prog: str, description: str, default_name: str) -> T:
    """`--config FILE key=value ...` -> a loaded `cls`; an empty `name` becomes the file's stem.

    The shared command line of the long jobs (datagen, sweep): one YAML file, overrides last.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=config_help(cls),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"YAML file of {cls.__name__} keys (listed below)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
    args = parser.parse_args(argv)
    cfg = load_config(cls, args.config, args.overrides)
    if not cfg.name:
        cfg.name = Path(args.config).stem if args.config else default_name
    return cfg
