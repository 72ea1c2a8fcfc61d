"""The command lines' argument helpers: the parser every subcommand builds and the flags made from the typed
settings (params.py). A leaf below cli.py and the subcommands' modules (evaluation/probe.py), so that a
subcommand builds `generate`'s pair flags without importing the command line that loads it."""
from __future__ import annotations

import argparse
import sys
import typing


class Parser(argparse.ArgumentParser):
    """Bad arguments get the one `error: ...` line every other mistake gets, not a usage dump."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_fields(g, fields: dict, note) -> None:
    """One flag per typed field (params.py): its name, help and choices come from the field; the
    value is left as typed and the params class converts and checks it, once. Unset flags stay None,
    so the class's defaults apply and a flag that does not apply to a policy can be refused."""
    for key, f in fields.items():
        extra = f.json_schema_extra or {}
        if extra.get("cli", True) is False:
            continue
        # a Literal's values (auto in `int | Literal["auto"]` is not a closed set)
        choices = list(typing.get_args(f.annotation)) if typing.get_origin(f.annotation) is typing.Literal else None
        text = (f.description or key.replace("_", " ")) + note(key)
        if f.annotation is bool:
            g.add_argument(flag(key), dest=key, action="store_true", default=None, help=text)
        else:
            g.add_argument(flag(key), dest=key, default=None, choices=choices, help=text,
                           metavar=None if choices else key.upper())


def set_fields(args, fields) -> dict:
    """The fields given on the command line (the unset ones are None: the params class's defaults apply)."""
    return {k: getattr(args, k) for k in fields if getattr(args, k, None) is not None}
