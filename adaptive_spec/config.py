"""Flat configs loaded from YAML, with `key=value` overrides from the command line.

A config is a pydantic model on `Config`, as the pair's and the policies' settings are (params.py);
typed.py's explain_config words a refusal in one line, and this module adds the YAML file, the overrides
and the checks across keys (a config's `validate`). Unknown keys are refused with the list of valid ones,
because a silently ignored typo costs a whole run. A field typed as a params.py class (`pair: PairParams`)
is a YAML mapping checked by that class; `pair.draft=...` overrides one of its keys."""
from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import UserError
from .typed import Params, build, explain_config, params_fields, unknown_keys

T = TypeVar("T", bound="Config")


class Config(BaseModel):
    """A YAML config: unknown keys refused, each value checked against its field's type on construction (a
    refusal is one UserError line). Not frozen: the loader names an unnamed config, and `validate` writes some
    keys back in their canonical form. Fields assigned later are not checked again."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @model_validator(mode="wrap")
    @classmethod
    def _one_line(cls, values: Any, handler, info):
        """A refusal as one UserError line: keys spelled as the YAML has them when the loader builds the config
        (its context), as keywords when Python code does."""
        try:
            return handler(values)
        except ValidationError as e:
            spell = (lambda key: f"config key '{key}'") if (info.context or {}).get("yaml") else str
            raise UserError(explain_config(e, cls, spell)) from None

    def validate(self) -> None:
        """The checks across keys (and of what a key names), which the loader runs once the types fit; a
        config class lists its own. Overrides pydantic's deprecated classmethod of the same name."""


def _as_text(cls: type[Config], raw: dict[str, Any]) -> dict[str, Any]:
    """YAML reads `name: 7` as a number; a field of type str takes it as text."""
    text = {k for k, f in cls.model_fields.items() if f.annotation in (str, str | None)}
    return {k: str(v) if k in text and isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in raw.items()}


def _nest_dotted(cls: type[Config], raw: dict[str, Any]) -> dict[str, Any]:
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


def _build_params(cls: type[Config], raw: dict[str, Any]) -> dict[str, Any]:
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


def config_help(cls: type[Config]) -> str:
    """Every key of `cls` with its default, for --help: the config file and key=value take these."""
    lines = [f"config keys (YAML or key=value; default in brackets) of {cls.__name__}:"]
    nested = params_fields(cls)
    for key, f in cls.model_fields.items():
        if key in nested:  # one line per setting of the mapping: pair.draft [...]
            lines += [f"  {key}.{k} [{v.default!r}]" for k, v in nested[key].model_fields.items()]
        else:
            default = "(required)" if f.is_required() else f.get_default(call_default_factory=True)
            lines.append(f"  {key} [{default!r}]")
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
    unknown = sorted(set(raw) - set(cls.model_fields))
    if unknown:
        raise UserError(unknown_keys(cls, unknown))
    lists = {k for k, f in cls.model_fields.items() if typing.get_origin(f.annotation) in (list, tuple)}
    raw = {k: ([v] if k in lists and not isinstance(v, (list, tuple)) else v) for k, v in raw.items()}
    cfg = cls.model_validate(_as_text(cls, _build_params(cls, raw)), context={"yaml": True})
    cfg.validate()
    return cfg


def config_from_argv(cls: type[T], argv, prog: str, description: str, default_name: str) -> T:
    """`--config FILE key=value ...` -> a loaded `cls`; an empty `name` becomes the file's stem.

    The shared command line of the long jobs (datagen, sweep): one YAML file, overrides last."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=config_help(cls),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"YAML file of {cls.__name__} keys (listed below)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied last")
    args = parser.parse_args(argv)
    cfg = load_config(cls, args.config, args.overrides)
    if not cfg.name:
        cfg.name = Path(args.config).stem if args.config else default_name
    return cfg
