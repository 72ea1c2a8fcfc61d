"""How a typed settings class is built and refused in one line, and how a policy's settings join the policy
registry (registry.py) under their `--policy` name; the settings themselves are params.py's, but for
SamplingParams, which every decode takes (backends/logits.py applies it). A YAML config (config.py) is refused
here too, in the words of its keys (explain_config). Nothing here imports torch: every refusal comes before the
weights.

    from adaptive_spec.typed import policy_class
    list(policy_class("learned").model_fields)    # ['head', 'threshold', 'k_max', 'curve']"""
from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from . import registry
from .errors import UserError
from .registry import Needs

AUTO = "auto"


class Params(BaseModel):
    """Frozen, typed, unknown keys refused. `expects` in a field's json_schema_extra words what it
    takes, for the one-line error."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


def expecting(text: str) -> dict:
    return {"json_schema_extra": {"expects": text}}


def build(cls: type[Params], values: dict, where: str, spell=lambda key: key) -> Params:
    """cls(**values), or one UserError line: `where` names the object (e.g. "policy learned"),
    `spell` how a key is written where the user wrote it (a flag, a YAML key)."""
    try:
        return cls(**values)
    except ValidationError as e:
        raise UserError(explain(e, cls, where, spell)) from None


def explain(err: ValidationError, cls: type[Params], where: str, spell=lambda key: key) -> str:
    errors = err.errors()
    auto = [str(x["loc"][0]) for x in errors if x["loc"] and x.get("input") == AUTO]
    if auto and _auto_owners(auto[0]):  # auto given to a policy whose setting takes none
        return (f"{spell(auto[0])} auto is for --policy {' or '.join(_auto_owners(auto[0]))}; {where} takes a "
                "number (or drop it for the default)")
    unknown = [str(x["loc"][0]) for x in errors if x["type"] == "extra_forbidden"]
    if unknown:
        valid = ", ".join(spell(k) for k in cls.model_fields) or "none"
        return (f"{', '.join(spell(k) for k in unknown)}: not a setting of {where} (its settings: {valid})")
    first = errors[0]
    if not first["loc"]:  # a model validator: its message is the whole story
        return first["msg"].removeprefix("Value error, ")
    key = str(first["loc"][0])
    field = cls.model_fields.get(key)
    expects = ((field.json_schema_extra or {}).get("expects") if field is not None else None)
    if first["type"] == "missing":
        return f"{where} needs {spell(key)}" + (f" ({expects})" if expects else "")
    what = expects or first["msg"].removeprefix("Value error, ").lower()
    return f"{spell(key)} must be {what} for {where}, got {first['input']!r}"


def fits(cls: type[BaseModel], key: str, value: Any) -> bool:
    """Whether `value` is a valid `key` of `cls` on its own, the other settings unchecked (a sweep lists the
    values of one policy setting, the rest of a configuration is checked where it is built)."""
    f = cls.model_fields[key]
    try:
        TypeAdapter(Annotated[f.annotation, f]).validate_python(value)
    except ValidationError:
        return False
    return True


def params_fields(cls: type[BaseModel]) -> dict[str, type[Params]]:
    """The fields of `cls` that hold a Params class (e.g. a config's pair: PairParams), by name."""
    return {k: f.annotation for k, f in cls.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, Params)}


def unknown_keys(cls: type[BaseModel], unknown: list[str]) -> str:
    """The refusal of config keys `cls` does not have: where one is a setting of a nested section (`pair:`),
    where to write it; then the valid keys."""
    where = ""
    for name, pcls in params_fields(cls).items():
        nested = [k for k in unknown if k in pcls.model_fields]
        if nested:
            where += (f"; {', '.join(nested)} {'is a' if len(nested) == 1 else 'are'} {name} setting"
                      f"{'s' if len(nested) > 1 else ''}: write {name}: {{{nested[0]}: ...}}, or "
                      f"{name}.{nested[0]}=... on the command line")
    return (f"unknown config key(s) {', '.join(repr(k) for k in unknown)} for {cls.__name__}{where}; "
            f"valid keys: {', '.join(cls.model_fields)}")


def explain_config(err: ValidationError, cls: type[BaseModel], spell=str) -> str:
    """explain's sibling for a config (config.py): pydantic converts each value to its field's type (lax: "4" -> 4,
    "true" -> True), and a value that does not fit is named as `spell` writes its key (the loader: as the YAML)."""
    errors = err.errors()
    missing = [str(x["loc"][0]) for x in errors if x["type"] == "missing"]
    if missing:
        return f"config is missing required key(s): {', '.join(missing)}"
    unknown = [str(x["loc"][0]) for x in errors if x["type"] == "extra_forbidden"]
    if unknown:
        return unknown_keys(cls, unknown)
    first = errors[0]
    key = str(first["loc"][0]) if first["loc"] else "?"
    hint = cls.model_fields[key].annotation if key in cls.model_fields else Any
    if typing.get_origin(hint) is typing.Literal:
        return f"{spell(key)} must be one of {', '.join(map(str, typing.get_args(hint)))}, got {first['input']!r}"
    return (f"{spell(key)} must be of type {getattr(hint, '__name__', str(hint))}, got {first['input']!r} "
            f"({first['msg'].lower()})")


def policy_classes() -> dict[str, type["PolicyParams"]]:
    return {e.name: e.params for e in registry.entries() if e.params is not None}


def _auto_owners(key: str) -> list[str]:
    return [n for n, cls in policy_classes().items()
            if key in cls.model_fields and "'auto'" in str(cls.model_fields[key].annotation)]


class SamplingParams(Params):
    """Temperature, top-k and top-p, checked on construction: SamplingParams(1.0, 50) as well as by keyword."""

    temperature: float = Field(1.0, ge=0, **expecting(">= 0 (0 = greedy)"))
    top_k: int = Field(0, ge=0, **expecting(">= 0 (0 = off)"))
    top_p: float = Field(1.0, gt=0, le=1, **expecting("in (0, 1] (1 = off)"))

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        try:
            super().__init__(temperature=temperature, top_k=top_k, top_p=top_p)
        except ValidationError as e:
            raise UserError(explain(e, SamplingParams, "sampling", lambda key: key.replace("_", "-"))) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __str__(self) -> str:  # as text (json's default=str in records and cache keys), the call that makes it
        return repr(self)


PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
UnitOpen = Annotated[float, Field(gt=0, lt=1)]


class PolicyParams(Params):
    """A policy's settings. Subclasses register under their `--policy` name (`policy`), in the decoding
    layer's registry (decoding/registry.py), which the policy's factory joins."""

    name: ClassVar[str] = ""
    # what the policy needs of an engine whatever its settings (backends/engines.py CAPABILITIES)
    static_needs: ClassVar[frozenset] = frozenset()

    @property
    def needs(self) -> Needs:
        """What the policy needs with these settings: a draft model, a prefilled draft, engine capabilities
        (read by check_runs_on, the command line, the sweep, and through the built policy by the decoder)."""
        return Needs(engine=self.static_needs)

    def check_sampling(self, temperature: float) -> None:
        """Refuse a decode mode the policy is not defined for (the oracle: greedy only)."""


def policy(name: str):
    """Declare a params class as policy `name`'s settings in the registry (its factory joins it through
    interfaces.register)."""

    def deco(cls):
        cls.name = name
        registry.declare(name, params=cls)
        return cls

    return deco


def policy_class(name: str) -> type[PolicyParams]:
    return registry.entry(name).params


policy_names = registry.names  # every name, "ar" first


def policy_fields() -> dict[str, Any]:
    """Every policy setting by name (the first declaration's field): the command line's flags."""
    out: dict[str, Any] = {}
    for cls in policy_classes().values():
        for key, f in cls.model_fields.items():
            out.setdefault(key, f)
    return out


def policies_with(key: str) -> list[str]:
    return [n for n, cls in policy_classes().items() if key in cls.model_fields]

