"""The policy registry: one entry per `--policy` name, holding its settings class and its factory.

The settings class (a `typed.PolicyParams`) is declared when params is imported, so the command line, the
sweep and every refusal know all names and settings before torch loads; the factory `(settings, context) ->
policy` by the policy's own module (`interfaces.register`), imported when a pair decodes. A leaf (stdlib
only) below both, so the settings read it without importing decoding/."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import UserError


@dataclass(frozen=True)
class Needs:
    """What a policy needs of the pair it decodes with."""

    draft_model: bool = True  # it drafts with the draft model (a pair then loads one)
    # the draft reads the prompt before the first round; False: it catches up in its first model round
    # (prompt lookup with a model fallback: a generation that never falls back never pays the draft's prefill)
    prefilled_draft: bool = True
    engine: frozenset = frozenset()  # the engine capabilities it uses (backends/engines.CAPABILITIES)


@dataclass
class Entry:
    name: str
    params: Any = None  # its settings class (typed.PolicyParams subclass)
    factory: Callable[..., Any] | None = None  # (settings, context) -> Policy; None for "ar" (no policy)


_ENTRIES: dict[str, Entry] = {}


def declare(name: str, params: Any = None, factory: Callable[..., Any] | None = None) -> Entry:
    """Fill `name`'s entry with its settings class and/or its factory (each declared once, where it lives)."""
    e = _ENTRIES.setdefault(name, Entry(name))
    if params is not None:
        e.params = params
    if factory is not None:
        e.factory = factory
    return e


def names() -> list[str]:
    """Every policy name, in declaration order ("ar" first)."""
    return list(_ENTRIES)


def entries() -> list[Entry]:
    return list(_ENTRIES.values())


def entry(name: str) -> Entry:
    if name not in _ENTRIES:
        raise UserError(f"unknown policy {name!r}; valid policies: {', '.join(_ENTRIES)}")
    return _ENTRIES[name]


def entry_params(name: str) -> Any:
    """`name`'s settings class, or None where none was declared (yet)."""
    e = _ENTRIES.get(name)
    return None if e is None else e.params


def factory(name: str) -> Callable[..., Any]:
    e = entry(name)
    if e.factory is None:
        raise UserError(f"policy {name!r} has no decoder of its own (ar is the target alone); "
                        f"policies that draft: {', '.join(n for n, x in _ENTRIES.items() if x.factory)}")
    return e.factory

