"""The configurations a sweep runs: Configuration and build_grid, from a SweepConfig (sweep.py's docstring
has the keys), and the heads they run, loaded on the CPU and checked against the draft (load_heads).

Each Configuration holds its policy: the typed settings `generate` takes (built through the policy
registry), or a Baseline that is no registered policy. The shorthands (ks, heads x thresholds, taus) and
the `policies` / `trees` entries are first written out as Entries (policy name, settings), then typed in
one pass. What runs a configuration is chosen by its policy's type and its Source, never by a name."""
from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import torch

from ..backends.paths import FeatureDraft, resolve_model_path
from ..decoding.trees.policy import round_budget
from ..decoding.trees.shapes import NESTED
from ..errors import UserError
from ..heads.curve import load_curve
from ..heads.head import AcceptanceHead
from ..params import (ARParams, ConfidenceParams, EntropyParams, FixedParams, HeuristicParams, LearnedParams,
                      OracleParams)
from ..registry import Needs
from ..runs import PROJECT_ROOT
from ..typed import PolicyParams, build, policy_class, policy_classes
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


class Baseline(Enum):
    """A configuration that is no registered policy: the draft alone runs through generate as a pair of its own
    (SpecPair.draft_alone), the peers (PEERS) by transformers' own generate (sweep_run.hf_generate)."""

    DRAFT_AR = "draft_ar"  # the draft alone (stand-alone t_draft)
    HF_ASSISTED = "hf_assisted"  # transformers' assisted generation with the draft
    HF_PROMPT_LOOKUP = "hf_prompt_lookup"  # transformers' prompt lookup: no draft model

    @property
    def needs(self) -> Needs:
        return Needs(draft_model=self is not Baseline.HF_PROMPT_LOOKUP)


PEERS = (Baseline.HF_ASSISTED, Baseline.HF_PROMPT_LOOKUP)  # transformers' own generate: their rows' counts derived


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
    reads_auto: bool = False  # it picks K or h per machine (_reads_auto), set by build_grid


def _reads_auto(p) -> bool:
    """Whether a policy picks K or h per machine: auto written for k or threshold (a default auto, ngram's k, is no
    pick from a curve)."""
    written = [getattr(p, k) for k in ("k", "threshold") if k in p.model_fields_set] if isinstance(p, PolicyParams) else []
    return AUTO in written


def _row(method: str, **values) -> dict:
    return {k: values.get(k) for k in ROW_KEYS} | {"method": method}


@dataclass(frozen=True)
class Entry:
    """One configuration as the config writes it, before its settings are typed: its policy by name (a shorthand's:
    its params class; or a baseline) and its settings as given; `at` names it in a problem (policies[2], trees[0]; a
    shorthand: its key)."""

    policy: str | type[PolicyParams] | Baseline
    settings: dict
    source: Source
    at: str
    key: str | None = None  # None: a `trees` entry's, read from its typed settings
    row: dict | None = None
    head: str | None = None


def build_grid(cfg) -> tuple[list[Configuration], dict, list[str]]:
    """The configurations run on every prompt, in run order; the heads of `heads` (label -> folder); and notes
    on what was left out. Every shorthand and entry is first written out as an Entry, then all are typed in one
    pass; the curves the shorthands' auto picks from are checked last."""
    heads = dict(resolve_heads(cfg.heads))
    entries, notes = _shorthands(cfg, list(heads))
    entries += _tree_entries(cfg.trees, heads) + _policy_entries(cfg.policies)
    if not entries:
        raise UserError("the sweep grid is empty; enable include_ar, list ks, heads, ... in the config")
    grid, seen = [], {}
    for e in entries:
        conf = _configuration(e)
        conf = replace(conf, reads_auto=_reads_auto(conf.policy))
        if conf.key in seen:
            fix = " or give it a label" if e.source is Source.POLICIES else ""
            raise UserError(f"{e.at} repeats {seen[conf.key]} ({conf.key}); drop one{fix}")
        seen[conf.key] = e.at
        drafts = cfg.drafts if conf.policy.needs.draft_model else []
        grid += [replace(conf, key=f"{conf.key}@{d}", draft=d) for d in drafts] or [conf]
    _check_auto_curves(cfg, list(heads.values()))
    return grid, heads, notes


def _shorthands(cfg, labels: list[str]) -> tuple[list[Entry], list[str]]:
    """The entries of the shorthand keys (ks: [2, 3] is two fixed entries; heads x thresholds learned ones; the
    taus confidence and entropy ones), and a note where the oracle is left out."""
    def entry(key: str, policy, row: dict, head: str | None = None, **settings) -> Entry:
        return Entry(policy, settings, Source.SHORTHAND, key, key, row, head)

    out, notes = [], []
    if cfg.include_ar:
        out.append(entry("ar", ARParams, _row("ar")))
    if cfg.include_draft_ar:
        out.append(entry("draft_ar", Baseline.DRAFT_AR, _row("draft_ar")))
    out += [entry(f"fixed:k={k}", FixedParams, _row("fixed_auto" if k == AUTO else "fixed", k=k), k=k)
            for k in dict.fromkeys(cfg.ks)]
    out += [entry(f"learned:head={label}:h={_fmt(h)}", LearnedParams, _row("learned_auto" if h == AUTO else "learned",
                  head=label, h=h), label, threshold=h, k_max=cfg.k_max)
            for label in labels for h in dict.fromkeys(cfg.thresholds)]
    for cls, taus in ((ConfidenceParams, cfg.confidence_taus), (EntropyParams, cfg.entropy_taus)):
        out += [entry(f"{cls.name}:tau={t:g}", cls, _row(cls.name, tau=float(t)), threshold=float(t), k_max=cfg.k_max)
                for t in dict.fromkeys(taus)]
    if cfg.heuristic:
        out.append(entry("heuristic", HeuristicParams, _row("heuristic"), k_max=cfg.k_max))
    if cfg.oracle and cfg.temperature > 0:
        notes.append(f"oracle skipped: the hindsight oracle is defined for greedy decoding and this sweep "
                     f"samples at temperature {cfg.temperature:g}")
    elif cfg.oracle:
        out.append(entry("oracle", OracleParams, _row("oracle")))
    for on, baseline in ((cfg.hf_assisted, Baseline.HF_ASSISTED), (cfg.hf_prompt_lookup, Baseline.HF_PROMPT_LOOKUP)):
        if on:
            out.append(entry(baseline.value, baseline, _row(baseline.value)))
    return out, notes


def _policy_entries(policies) -> list[Entry]:
    """One entry per `policies` item: its settings as given, its key its label or its settings."""
    if not isinstance(policies, list):
        raise UserError(f"config key 'policies' must be a list of mappings such as {{policy: ngram, k: 3}}, "
                        f"got {policies!r}")
    out = []
    for i, e in enumerate(policies):
        if not isinstance(e, dict) or not isinstance(e.get("policy"), str):
            raise UserError(f"policies[{i}] must be a mapping with a policy name, e.g. {{policy: ngram, k: 3}}, "
                            f"got {e!r}")
        settings = {k: v for k, v in e.items() if k not in ("policy", "label")}
        key = str(e.get("label") or ":".join([e["policy"]] + [f"{k}={v}" for k, v in sorted(settings.items())]))
        row = _row(e["policy"], k=settings.get("k"), head=settings.get("head"), h=settings.get("threshold"))
        out.append(Entry(e["policy"], settings, Source.POLICIES, f"policies[{i}]", key, {**row, "settings": settings}))
    return out


def _configuration(e: Entry) -> Configuration:
    """The entry's configuration, its settings typed by its policy's class. A shorthand's are taken as given: each
    value was checked as its field by SweepConfig.validate, and the whole is checked by its class once Runner.run
    adds what only the loaded sweep knows (a head, an auto's curve). A `policies` or `trees` entry's are checked
    whole here, a problem naming the entry; a `trees` entry's key and row are read from them."""
    if isinstance(e.policy, Baseline):
        return Configuration(e.key, e.policy, e.source, e.row, e.head)
    if e.source is Source.SHORTHAND:  # its params class, named by _shorthands
        return Configuration(e.key, e.policy.model_construct(**e.settings), e.source, e.row, e.head)
    try:
        policy = build(policy_class(e.policy), e.settings, f"policy {e.policy}", _speller(e))
    except UserError as err:  # the registry's classes: None for a name it does not know
        raise UserError(_explained(e, policy_classes().get(e.policy), str(err))) from None
    if e.source is Source.POLICIES:
        return Configuration(e.key, policy, e.source, e.row)
    if policy.name not in MULTI_DRAFT:  # what the policy would refuse only once built (decoding/trees/policy.py)
        _check_tree_shape(policy, _speller(e))
    return Configuration(_tree_key(policy, e.head), policy, Source.TREES,
                         {**_row(policy.name), **tree_row_fields(policy, e.head)}, e.head)


def _speller(e: Entry):
    """How a problem spells a setting: a `trees` entry's as trees[i].key, a `policies` entry's as its key."""
    return (lambda key: f"{e.at}.{key}") if e.source is Source.TREES else (lambda key: key)


def auto_curve(curve: str, folders: list) -> str:
    """The curve `ks: [auto]` picks from: `curve`, else the one beside the first head of `heads`."""
    return curve or str(folders[0])


def _check_auto_curves(cfg, folders: list) -> None:
    """Every curve a shorthand auto picks from exists and fits; the error names the config key and the command
    that makes the curve. With auto_prompts the curves are made once the pair has loaded (Runner.run), from
    those prompts' answers: there is nothing to check yet."""
    if cfg.auto_prompts:
        return
    checks = [("ks", auto_curve(cfg.curve, folders), "k", None)] if AUTO in cfg.ks else []
    checks += [("thresholds", str(f), "h", str(f)) for f in folders] if AUTO in cfg.thresholds else []
    for key, source, need, head in checks:
        try:
            curve = load_curve(source, need, head)
        except UserError as e:
            raise UserError(f"config key '{key}' lists auto: {e}") from None
        if need == "h" and curve["k_max"] != cfg.k_max:
            raise UserError(f"config key 'thresholds' lists auto, but the curve beside {source} was made with "
                            f"k_max {curve['k_max']}, not the sweep's k_max {cfg.k_max}; set k_max: "
                            f"{curve['k_max']}, or rerun autotune with --k-max {cfg.k_max}")


def head_folder(p: Path) -> Path | None:
    if (p / "config.json").is_file():
        return p
    if (p / "head" / "config.json").is_file():  # a training output dir: its exported head
        return p / "head"
    return None


def resolve_heads(patterns: list[str]) -> list[tuple[str, Path]]:
    """(label, folder) per head. A path may be a head folder, a training output dir holding head/, or
    a glob over those (folders without a head are skipped for globs). Relative paths: working
    directory first, then the project root."""
    found: list[Path] = []
    for pat in patterns:
        pat = str(Path(pat).expanduser())
        if glob.has_magic(pat):
            bases = [Path.cwd()] if Path(pat).is_absolute() else [Path.cwd(), PROJECT_ROOT]
            per_base = ([h for h in map(head_folder, map(Path, sorted(glob.glob(str(b / pat))))) if h] for b in bases)
            hits = next(filter(None, per_base), [])  # the first base with a match
            if not hits:
                raise UserError(f"no acceptance head folders match {pat!r}; train one with "
                                "`python train.py --config configs/train/default.yaml` or fix the heads list")
            found += hits
            continue
        found.append(find_head_folder(pat) or Path(pat))  # a missing one fails in from_pretrained
    found = list(dict.fromkeys(f.resolve() if f.exists() else f for f in found))
    labels = [f.parent.name if f.name == "head" else f.name for f in found]
    if len(set(labels)) != len(labels):  # same folder names: fall back to the full paths
        labels = [str(f) for f in found]
    return list(zip(labels, found))


def find_head_folder(h: str) -> Path | None:
    """The head folder a path names (working directory first, then the project root), or None."""
    p = Path(h).expanduser()
    return next((f for f in map(head_folder, [p] if p.is_absolute() else [p, PROJECT_ROOT / p]) if f), None)


def load_heads(draft: str | FeatureDraft | None, listed: dict, named: dict) -> dict:
    """{label: (AcceptanceHead on CPU, info: path, depth, w_rej, train/dev metrics)} of every head the grid runs.
    `listed`: label -> folder of `heads`; `named`: the same of the heads `trees` entries name (a label of heads, or
    a folder, then labelled as written), each checked to be a token head. A head trained for another draft than
    `draft` is refused here, before any model loads."""
    hidden, heads = draft_hidden_size(draft), {}
    for label, folder in {**listed, **named}.items():
        head = AcceptanceHead.from_pretrained(folder, hidden_size=hidden, dtype=torch.float32,
                                              draft_model=None if draft is None else str(draft))
        if label in named and getattr(head, "feature", "token") != "token":
            raise UserError(f"trees: head {label} reads feature={head.feature}, but the tree estimator scores each "
                            "drafted node from its own hidden state and needs a head trained with feature=token")
        extra = dict(head.extra)
        metrics = extra.pop("metrics", None)
        mfile = Path(folder) / "metrics.json"
        if metrics is None and mfile.is_file():
            try:
                metrics = json.loads(mfile.read_text())
            except json.JSONDecodeError:
                metrics = None
        heads[label] = head, {"label": label, "path": str(folder), "depth": head.depth, "hidden_size": head.hidden_size,
                              "draft_model": head.draft_model, "w_rej": extra.get("w_rej"), "step": extra.get("step"),
                              "metrics": metrics or {},
                              "extra": {k: v for k, v in extra.items() if k not in ("w_rej", "step")}}
    return heads


def draft_hidden_size(draft: str | FeatureDraft) -> int | None:
    """The draft's hidden size from its config.json when it is a local folder (no weights loaded); a feature
    drafter's folder records it too (the target's, which its states have)."""
    try:
        path = Path(draft.path if isinstance(draft, FeatureDraft) else resolve_model_path(draft, "draft",
                                                                                         auto_fetch=False))
    except UserError:
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):  # no config.json (or not a local folder), or a corrupt one
        return None
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    return int(h) if h else None


MULTI_DRAFT = ("spectr", "batch-sd")
# set by the sweep itself: the rates are measured once per sweep on calibration prompts (tree_calibration)
SWEEP_SETS = ("tree_rates",)
# the sweep's names before its entries took generate's: refused, naming what to write instead
RENAMED = {"budget": "tree_budget (budget: learned -> tree_learned: true)", "max_budget": "tree_budget",
           "node_cost": "tree_node_cost (auto: leave it out)", "estimator": "tree_estimator",
           "adapt": "adapt_rates (the old default was adapt_rates: false)"}


def _one_of(values) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


def _tree_entries(trees, heads: dict) -> list[Entry]:
    """One entry per `trees` item: its policy (tree by default) and its settings, a head named by its label in
    `heads` (label -> folder) or by its folder (then the head is labelled as written). A problem names the
    entry's key (trees[i].key)."""
    if not isinstance(trees, list):
        raise UserError(f"config key 'trees' must be a list of mappings, got {trees!r}")
    out = []
    for i, e in enumerate(trees):
        at = f"trees[{i}]"
        if not isinstance(e, dict):
            raise UserError(f"{at} must be a mapping such as {{policy: tree, tree_budget: 8}}, got {e!r}")
        policy = e.get("policy", "tree")
        if policy not in TREE_POLICIES:
            raise UserError(f"{at}.policy: unknown policy {policy!r}; use {_one_of(TREE_POLICIES)}")
        for key in SWEEP_SETS:
            if key in e:
                raise UserError(f"{at}.{key}: the sweep measures the acceptance rates itself, once, on calibration "
                                "prompts (tree_calibration_prompts, tree_calibration_width); drop it")
        values = {k: v for k, v in e.items() if k != "policy"}
        if values.get("head") is not None:  # a label of heads or a folder: the params class checks the folder
            values["head"] = _tree_head(e["head"], at, heads)
        elif values.get("tree_estimator") == "head":
            raise UserError(f"{at}.head: tree_estimator head needs an acceptance head; set head to a label of heads "
                            f"({', '.join(heads) or 'none listed'}) or a head folder, or use tree_estimator positional")
        out.append(Entry(policy, values, Source.TREES, at, head=e.get("head")))
    return out


def _explained(e: Entry, cls, msg: str) -> str:
    """A problem with an entry's settings as the config writes them: naming the entry, a `trees` entry's unknown
    key with the settings it has (the sweep's old names naming the new), generate's flags as the entry's keys."""
    if cls is None:  # no such policy
        return f"{e.at}: {msg}"
    valid = ["policy", *(k for k in cls.model_fields if k not in SWEEP_SETS)]
    unknown = [k for k in e.settings if k not in valid] if e.source is Source.TREES else []
    if unknown:
        renamed = f" (the sweep's old name: write {RENAMED[unknown[0]]})" if unknown[0] in RENAMED else ""
        return f"{e.at}.{unknown[0]}: not a setting of policy {e.policy}{renamed}; its settings: {', '.join(valid)}"
    msg = _as_keys(msg, cls)
    return msg if msg.startswith(e.at) else f"{e.at}: {msg}"


def _check_tree_shape(obj, spell) -> None:
    """A tree entry's estimator and budget against its drafting, refused before anything loads."""
    if obj.tree_estimator == "head" and obj.drafting != "tree":
        raise UserError(f"{spell('tree_estimator')}: the head estimator builds the optimal tree; use it with "
                        "drafting tree, or tree_estimator positional")
    if obj.tree_learned and obj.drafting not in NESTED:
        raise UserError(f"{spell('tree_learned')}: a learned budget grows the tree node by node, which drafting "
                        f"{obj.drafting} cannot; use drafting {_one_of(NESTED)}, or a fixed budget")


def _tree_head(h, at: str, heads: dict) -> str:
    """The folder of an entry's head: a label of `heads`, or a head folder (as written)."""
    if not isinstance(h, str) or not h:
        raise UserError(f"{at}.head: must be a label of heads or a head folder, got {h!r}")
    if h in heads:
        return str(heads[h])
    folder = find_head_folder(h)
    if folder is None:
        raise UserError(f"{at}.head: {h!r} is neither a label of heads ({', '.join(heads) or 'none listed'}) "
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
