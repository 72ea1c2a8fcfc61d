"""The configurations a sweep runs: Configuration and build_grid, from a SweepConfig (sweep_config.py). Part
of `adaptive-spec sweep` (sweep.py: the module doc has the keys).

The grid is a list of Configurations, each holding its policy: the typed settings `generate` takes
(params.py, built through the policy registry), or a Baseline that is no registered policy. The
shorthands expand to that list (ks: [2, 3] is two fixed policies; heads x thresholds learned ones;
the taus confidence and entropy ones), and a `policies` or `trees` entry is spelled and defaulted as
generate's keywords are. What runs a configuration is chosen by its policy's type and its Source,
never by a name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ..decoding.trees.policy import round_budget
from ..decoding.trees.shapes import NESTED
from ..errors import UserError
from ..params import policy_params
from ..registry import Needs
from ..typed import PolicyParams, build, policy_class, policy_names
from .sweep_heads import find_head_folder, resolve_heads
from .tree_calibration import TREE_POLICIES

AUTO = "auto"


def _as_keys(msg: str, cls) -> str:
    """A params error in the config's spelling: the settings its cross-field checks name as generate's
    flags (--tree-learned) named as the entry's keys (tree_learned)."""
    def key(m):
        k = m[1].replace("-", "_")
        return k if k in cls.model_fields else m[0]
    return re.sub(r"--([a-z][a-z0-9-]*)", key, msg)


def _fmt(v) -> str:
    return v if v == AUTO else f"{v:g}"


# ----------------------------------------------------------------------------- the grid

class Baseline(Enum):
    """A configuration that is no registered policy: each runs by code of its own (sweep_run)."""

    DRAFT_AR = "draft_ar"  # the draft alone (stand-alone t_draft)
    HF_ASSISTED = "hf_assisted"  # transformers' assisted generation with the draft
    HF_PROMPT_LOOKUP = "hf_prompt_lookup"  # transformers' prompt lookup: no draft model

    @property
    def needs(self) -> Needs:
        return Needs(draft_model=self is not Baseline.HF_PROMPT_LOOKUP)


class Source(Enum):
    """The part of the config a configuration comes from: what Runner.run adds to its policy, and what its rows carry."""

    SHORTHAND = "shorthand"  # include_ar, ks, heads x thresholds, the taus, heuristic, oracle and the baselines
    POLICIES = "policies"  # a `policies` entry: complete as given
    TREES = "trees"  # a `trees` entry: run with the sweep's calibrated rates (and measured node cost)


ROW_KEYS = ("method", "k", "head", "h", "tau")  # every row has them, in this order (the report reads them)


@dataclass(frozen=True)
class Configuration:
    """One configuration of the grid: its key, its policy, and its fields in result rows."""

    key: str  # unique within a sweep (rows' `config`), e.g. "fixed:k=4", "learned:head=d3-wrej6:h=0.7"
    policy: PolicyParams | Baseline  # the settings `generate` takes (params.py), or a baseline
    source: Source
    row: dict  # its fields in rows as stored results name them: ROW_KEYS, then `settings` or tree_row_fields
    head: str | None = None  # the loaded head Runner.run puts in the policy: a label of `heads` or a trees entry's folder
    draft: str | None = None  # its `drafts` entry (None: the pair's own draft)

    def reads_auto(self) -> bool:
        """Whether it picks K or h per machine: auto written for k or threshold (a default auto, ngram's k, is no
        pick from a curve)."""
        p = self.policy
        return isinstance(p, PolicyParams) and AUTO in [getattr(p, k) for k in ("k", "threshold")
                                                        if k in p.model_fields_set]

    def row_fields(self) -> dict:
        base = {"config": self.key, **{k: self.row.get(k) for k in ROW_KEYS}}
        if self.draft is not None:  # a `drafts` entry: the draft configuration it ran with
            base["draft"] = self.draft
        return {**base, **self.row}


def completed(policy: PolicyParams, **more) -> PolicyParams:
    """`policy` with settings only the loaded sweep knows (a head object, a curve), checked whole by its class."""
    given = {k: getattr(policy, k) for k in policy.model_fields_set}
    return policy_params(policy.name, **{**given, **more})


def _row(method: str, **values) -> dict:
    return {k: values.get(k) for k in ROW_KEYS} | {"method": method}


def _shorthand(key: str, policy, row: dict, head: str | None = None) -> Configuration:
    return Configuration(key, policy, Source.SHORTHAND, row, head)


def _unchecked(name: str, **values) -> PolicyParams:
    """A shorthand policy that lacks what only the loaded sweep knows (a head, an auto's curve): each value is
    checked as its field by SweepConfig.validate, the whole by its class once Runner.run completes it."""
    return policy_class(name).model_construct(**values)


def build_grid(cfg, head_labels: list[str]) -> tuple[list[Configuration], list[str]]:
    """The configurations run on every prompt, in run order, and notes on what was left out."""
    grid, notes = [], []
    if cfg.include_ar:
        grid.append(_shorthand("ar", policy_params("ar"), _row("ar")))
    if cfg.include_draft_ar:
        grid.append(_shorthand("draft_ar", Baseline.DRAFT_AR, _row("draft_ar")))
    grid += [_shorthand(f"fixed:k={k}", _unchecked("fixed", k=k), _row("fixed_auto" if k == AUTO else "fixed", k=k))
             for k in dict.fromkeys(cfg.ks)]
    grid += [_shorthand(f"learned:head={label}:h={_fmt(h)}", _unchecked("learned", threshold=h, k_max=cfg.k_max),
                        _row("learned_auto" if h == AUTO else "learned", head=label, h=h), label)
             for label in head_labels for h in dict.fromkeys(cfg.thresholds)]
    for name, taus in (("confidence", cfg.confidence_taus), ("entropy", cfg.entropy_taus)):
        grid += [_shorthand(f"{name}:tau={t:g}", policy_params(name, threshold=float(t), k_max=cfg.k_max),
                            _row(name, tau=float(t))) for t in dict.fromkeys(taus)]
    if cfg.heuristic:
        grid.append(_shorthand("heuristic", policy_params("heuristic", k_max=cfg.k_max), _row("heuristic")))
    if cfg.oracle and cfg.temperature > 0:
        notes.append(f"oracle skipped: the hindsight oracle is defined for greedy decoding and this sweep "
                     f"samples at temperature {cfg.temperature:g}")
    elif cfg.oracle:
        grid.append(_shorthand("oracle", policy_params("oracle"), _row("oracle")))
    for on, baseline in ((cfg.hf_assisted, Baseline.HF_ASSISTED), (cfg.hf_prompt_lookup, Baseline.HF_PROMPT_LOOKUP)):
        if on:
            grid.append(_shorthand(baseline.value, baseline, _row(baseline.value)))
    grid += tree_specs(cfg) + policy_specs(cfg)
    if not grid:
        raise UserError("the sweep grid is empty; enable include_ar, list ks, heads, ... in the config")
    return per_draft(grid, cfg.drafts), notes


def per_draft(grid: list[Configuration], drafts: list[str]) -> list[Configuration]:
    """Each configuration that drafts with the draft model once per `drafts` entry (key KEY@ENTRY),
    the others (the target alone, prompt lookup) once; prompt-major, so one prompt runs them all."""
    if not drafts:
        return grid
    out = []
    for c in grid:
        out += [replace(c, key=f"{c.key}@{d}", draft=d) for d in drafts] if c.policy.needs.draft_model else [c]
    return out


def policy_specs(cfg) -> list[Configuration]:
    """One Configuration per `policies` entry, its settings checked by the policy's params class (a problem
    names the entry: policies[i])."""
    if not isinstance(cfg.policies, list):
        raise UserError(f"config key 'policies' must be a list of mappings such as {{policy: ngram, k: 3}}, "
                        f"got {cfg.policies!r}")
    grid, seen = [], {}
    for i, e in enumerate(cfg.policies):
        if not isinstance(e, dict) or not isinstance(e.get("policy"), str):
            raise UserError(f"policies[{i}] must be a mapping with a policy name, e.g. {{policy: ngram, k: 3}}, "
                            f"got {e!r}")
        settings = {k: v for k, v in e.items() if k not in ("policy", "label")}
        try:
            policy = policy_params(e["policy"], **settings)
        except UserError as err:
            msg = _as_keys(str(err), policy_class(e["policy"])) if e["policy"] in policy_names() else str(err)
            raise UserError(f"policies[{i}]: {msg}") from None
        key = str(e.get("label") or ":".join([policy.name] + [f"{k}={v}" for k, v in sorted(settings.items())]))
        if key in seen:
            raise UserError(f"policies[{i}] repeats policies[{seen[key]}] ({key}); drop one or give it a label")
        seen[key] = i
        row = _row(policy.name, k=settings.get("k"), head=settings.get("head"), h=settings.get("threshold"))
        grid.append(Configuration(key, policy, Source.POLICIES, {**row, "settings": settings}))
    return grid


# ----------------------------------------------------------------------------- `trees` entries

MULTI_DRAFT = ("spectr", "batch-sd")
# set by the sweep itself: the rates are measured once per sweep on calibration prompts (tree_calibration)
SWEEP_SETS = ("tree_rates",)
# the sweep's names before its entries took generate's: refused, naming what to write instead
RENAMED = {"budget": "tree_budget (budget: learned -> tree_learned: true)", "max_budget": "tree_budget",
           "node_cost": "tree_node_cost (auto: leave it out)", "estimator": "tree_estimator",
           "adapt": "adapt_rates (the old default was adapt_rates: false)"}


def _one_of(values) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


class _Labels:
    """The labels of `heads`, resolved once and only when an entry names a head."""

    def __init__(self, patterns: list[str]):
        self.patterns, self._resolved = patterns, None

    def resolved(self) -> list[tuple[str, Any]]:
        if self._resolved is None:
            self._resolved = resolve_heads(self.patterns)
        return self._resolved

    def __call__(self) -> list[str]:
        return [label for label, _ in self.resolved()]


def _tree_entry(cfg, e, at: str, labels: _Labels) -> tuple[str | None, Any]:
    """One `trees` entry: (its head as written, or None; its params object, head as a folder), checked by
    its policy's params class. A problem names the entry's key (at.key). `labels()`: the labels of `heads`,
    looked up only when an entry names a head."""
    if not isinstance(e, dict):
        raise UserError(f"{at} must be a mapping such as {{policy: tree, tree_budget: 8}}, got {e!r}")
    policy = e.get("policy", "tree")
    if policy not in TREE_POLICIES:
        raise UserError(f"{at}.policy: unknown policy {policy!r}; use {_one_of(TREE_POLICIES)}")
    cls = policy_class(policy)
    valid = ["policy", *(k for k in cls.model_fields if k not in SWEEP_SETS)]
    for key in e:
        if key in SWEEP_SETS:
            raise UserError(f"{at}.{key}: the sweep measures the acceptance rates itself, once, on calibration "
                            "prompts (tree_calibration_prompts, tree_calibration_width); drop it")
        if key not in valid:
            renamed = f" (the sweep's old name: write {RENAMED[key]})" if key in RENAMED else ""
            raise UserError(f"{at}.{key}: not a setting of policy {policy}{renamed}; its settings: {', '.join(valid)}")
    values = {k: v for k, v in e.items() if k != "policy"}
    spell = lambda key: f"{at}.{key}"  # noqa: E731
    if values.get("head") is not None:  # a label of heads or a folder: the params class checks the folder
        values["head"] = _tree_head(e["head"], spell, labels)
    elif values.get("tree_estimator") == "head":
        raise UserError(f"{at}.head: tree_estimator head needs an acceptance head; set head to a label of heads "
                        f"({', '.join(labels()) or 'none listed'}) or a head folder, or use tree_estimator positional")
    try:
        obj = build(cls, values, f"policy {policy}", spell)
    except UserError as err:
        msg = _as_keys(str(err), cls)
        raise UserError(msg if msg.startswith(at) else f"{at}: {msg}") from None
    if policy not in MULTI_DRAFT:  # what the policy would refuse only once built (decoding/trees/policy.py)
        _check_tree_shape(obj, spell)
    return e.get("head"), obj


def _check_tree_shape(obj, spell) -> None:
    """A tree entry's estimator and budget against its drafting, refused before anything loads."""
    if obj.tree_estimator == "head" and obj.drafting != "tree":
        raise UserError(f"{spell('tree_estimator')}: the head estimator builds the optimal tree; use it with "
                        "drafting tree, or tree_estimator positional")
    if obj.tree_learned and obj.drafting not in NESTED:
        raise UserError(f"{spell('tree_learned')}: a learned budget grows the tree node by node, which drafting "
                        f"{obj.drafting} cannot; use drafting {_one_of(NESTED)}, or a fixed budget")


def _tree_head(h, spell, labels: _Labels) -> str:
    """The folder of an entry's head: a label of `heads`, or a head folder (as written)."""
    if not isinstance(h, str) or not h:
        raise UserError(f"{spell('head')}: must be a label of heads or a head folder, got {h!r}")
    if h in labels():
        return str(dict(labels.resolved())[h])
    folder = find_head_folder(h)
    if folder is None:
        raise UserError(f"{spell('head')}: {h!r} is neither a label of heads ({', '.join(labels()) or 'none listed'}) "
                        "nor a head folder (one with config.json, or a training output dir holding head/)")
    return str(folder)


def tree_row_fields(p, head: str | None) -> dict:
    """A tree configuration's fields in its rows, named as the report and stored results.jsonl read them."""
    if p.name in MULTI_DRAFT:
        return {"num_drafts": p.num_drafts, "k": p.k}
    b = round_budget(p)
    row = {"drafting": p.drafting, "estimator": p.tree_estimator, "budget": "learned" if p.tree_learned else b,
           "head": head, "adapt": p.adapt_rates}
    return {**row, "max_budget": b} if p.tree_learned else row


def _tree_key(p, head: str | None) -> str:
    """The configuration's key: the same for an entry in generate's names and in the old ones."""
    if p.name in MULTI_DRAFT:
        return f"{p.name}:n={p.num_drafts}:k={p.k}"
    est = f"head={head}" if p.tree_estimator == "head" else "positional"
    b = round_budget(p)
    if p.tree_learned:
        c = p.tree_node_cost
        b = f"learned<={b}:c={AUTO if c is None else format(c, 'g')}"
    return f"{p.name}:{p.drafting}:{est}:b={b}" + (":adapt" if p.adapt_rates else "")


def tree_specs(cfg) -> list[Configuration]:
    """One Configuration per `trees` entry (checked: a problem raises a UserError naming trees[i].key).
    A head is named by its label in `heads`, or by its folder (then the folder, as written, is its label)."""
    if not isinstance(cfg.trees, list):
        raise UserError(f"config key 'trees' must be a list of mappings, got {cfg.trees!r}")
    labels = _Labels(cfg.heads)
    grid, seen = [], {}
    for i, e in enumerate(cfg.trees):
        head, policy = _tree_entry(cfg, e, f"trees[{i}]", labels)
        key = _tree_key(policy, head)
        if key in seen:
            raise UserError(f"trees[{i}] repeats trees[{seen[key]}] ({key}); drop one")
        seen[key] = i
        grid.append(Configuration(key, policy, Source.TREES, {**_row(policy.name), **tree_row_fields(policy, head)},
                                  head))
    return grid
