"""Evaluation sweeps (SpecDec++ section 5, appendix D): every decoding configuration on every prompt.

    adaptive-spec sweep --config configs/sweep/paper.yaml [key=value ...]

For each dataset and each prompt, all configurations run back to back, so machine noise hits them
alike and per-prompt ratios compare like with like:

    ar            target alone (autoregressive; stand-alone t_target)
    draft_ar      draft alone (stand-alone t_draft; its forwards are counted as N_draft)
    fixed k=K     SpecDec with a fixed candidate length, for each K in `ks`
    learned       SpecDec++: each acceptance head in `heads` x each threshold h in `thresholds`
    auto          `auto` in `ks` / `thresholds`: the K / h of best predicted throughput on this
                  machine (decoding/auto.py: the head's threshold_curve.json, `curve` for ks, and
                  t_draft / t_target measured at load), as methods fixed_auto / learned_auto; rows
                  add auto_value (the pick) and auto_predicted_tokens_per_s (decoding only)
    confidence    stop when q(y_i) < tau, for each tau in `confidence_taus`
    entropy       stop when H(q_i) > tau nats, for each tau in `entropy_taus`
    heuristic     transformers' +2/-1 schedule (when `heuristic`)
    oracle        the greedy hindsight oracle of Theorem 4.1 (when `oracle`; temperature 0 only)
    hf_assisted   the peer: transformers' own `target.generate(..., assistant_model=draft)` with its
                  default schedule (when `hf_assisted`); counts from forward hooks, N_discarded
                  derived as N_draft + N_target - N
    hf_prompt_lookup  the n-gram peer: transformers' `target.generate(..., prompt_lookup_num_tokens=10)`
                  (its documented setting; max_matching_ngram_size at its default), no draft model
    trees         tree and multi-draft baselines, one configuration per entry of `trees`:
                    {policy: tree | ersd, drafting: tree | sequence | batch | specinfer,
                     estimator: positional | head, head: LABEL-or-DIR (estimator head),
                     budget: N | learned, max_budget: N, node_cost: C | auto (budget learned),
                     adapt: false | true}
                    {policy: spectr | batch-sd, num_drafts: N, k: K}
                  e.g. trees: [{budget: 4}, {estimator: head, head: d3-wrej6, budget: 8},
                               {policy: ersd, budget: 8}, {policy: spectr, num_drafts: 2, k: 3}].
                  Their rows add tokens_per_target_forward, drafted_per_round, tree_depth (mean
                  depth of a round's drafted tree) and predicted_accepted (sum of R per round).
                  tree/ersd shapes use per-sibling acceptance rates measured ONCE per sweep on
                  calibration prompts (tree_calibration_prompts per dataset, from the end of each
                  shuffled set, never evaluated ones) and frozen for every run, or with `adapt: true`
                  the start of every run, from which the rates adapt to that run's rounds (reset per
                  run, so no run depends on another); a learned budget's node_cost auto is measured
                  once (costs.measure_costs, pinned in costs.json as below)

Output in out_dir (default runs/sweep/<config name>, relative to the project root):
    results.jsonl   one line per (dataset, prompt, config): all Metrics fields plus the config's
                    parameters; appended and fsynced, so a rerun of the same command skips what is
                    done (resume after a kill or Ctrl-C)
    settings.json   the settings the results depend on (models, dtype, device, threads, sampling,
                    lengths, seed); a rerun with other settings is refused (use another out_dir,
                    or overwrite=true to discard the old results)
    config.json     the full config, the grid and notes (e.g. "oracle skipped at temperature 1")
    heads.json      per head: path, depth, w_rej, train/dev metrics (for the report's Table 3)
    prompts.json    the prompts used, per dataset
    tree_calibration.json   the tree policies' acceptance rates and how they were measured (reused on
                    a rerun while its settings hold; refused, once tree rows used it, if they change)
    costs.json      t_draft, t_target, t_cand as measured once for every auto pick (K, h, a tree's
                    node cost); a rerun on the same machine and models reuses them, so a resumed
                    sweep picks what it picked before (measured afresh, with a warning, elsewhere)
Then `adaptive-spec report --sweep-dir DIR` writes the tables and Pareto plots.
"""
from __future__ import annotations

import glob
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm
from transformers.utils import is_sklearn_available
from transformers.utils import logging as hf_logging

from ..backends import engines
from ..backends.models import resolve_device, resolve_model_path
from ..config import config_from_argv, config_to_dict
from ..heads.curve import load_curve
from ..decoding.costs import measure_costs
from ..decoding.decoder import Decoder, Metrics
from ..decoding.interfaces import PolicyContext
from ..decoding.pipeline import SpecPair, make_policy
from ..decoding.sampling import SamplingParams
from ..decoding.trees.shapes import DRAFTINGS, NESTED
from ..errors import UserError, run_main
from ..heads.head import AcceptanceHead
from ..params import PairParams, check_runs_on, policy_params
from ..prompts import load_prompts
from ..runs import (PROJECT_ROOT, append_jsonl, lock_dir, project_path, read_json, read_jsonl, settings_problem,
                    write_json)
from ..timing import timed
from .tree_calibration import TREE_POLICIES, VERIFICATION, load_or_calibrate, measure_rates

RESULTS = "results.jsonl"
# config keys that change the numbers in results.jsonl; a resume must keep them (with the pair's, _settings)
RESULT_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "chat", "seed", "k_max", "max_prompt_tokens")
# the pair's settings in settings.json, which keeps them flat and spells unset ones as it always has
PAIR_RESULT_KEYS = ("backend", "n_ctx", "draft", "target", "dtype", "draft_quant", "draft_vocab", "threads")
UNSET = {"n_ctx": 0, "draft_vocab": "", "threads": 0}
# torch settings a sweep may set: recorded only when set, so an existing sweep's settings hash holds
PAIR_IF_SET = ("kv_cache", "runtime", "max_cache_len", "target_quant", "draft_context")


@dataclass
class SweepConfig:
    name: str = ""  # names the default out_dir runs/sweep/<name>; defaults to the config file's stem
    # the models, as `generate` takes them (params.PairParams): pair: {draft_quant: int8, backend: llama.cpp, ...}
    pair: PairParams = field(default_factory=PairParams)
    # prompts
    datasets: list[str] = field(default_factory=lambda: ["alpaca"])
    fields: dict = field(default_factory=dict)  # dataset -> text field (default: the set's own)
    hf_configs: dict = field(default_factory=dict)  # hub dataset -> configuration name
    hf_splits: dict = field(default_factory=dict)  # hub dataset -> split
    n_prompts: int = 30
    max_prompt_tokens: int = 1024  # longer prompts are skipped (the next shuffled prompt takes the place)
    chat: bool = True  # wrap prompts in the tokenizer's chat template
    # sampling (paper appendix D.1: T = 1, top-k 50)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 0  # prompt shuffle and generation seeds
    # the grid
    # and/or auto; a float is let through typing for validate() to refuse with its reason
    ks: list[int | float | str] = field(default_factory=lambda: list(range(1, 15)))
    heads: list[str] = field(default_factory=list)  # head folders (or training output dirs with head/); globs ok
    thresholds: list[float | str] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    curve: str = ""  # threshold_curve.json for `ks: [auto]` (default: the one beside the first head)
    k_max: int = 20  # hard cap on candidates per round for the adaptive policies (paper: 20)
    confidence_taus: list[float] = field(default_factory=list)
    entropy_taus: list[float] = field(default_factory=list)
    heuristic: bool = False
    oracle: bool = False  # greedy only; skipped with a note when temperature > 0
    include_ar: bool = True
    include_draft_ar: bool = True
    hf_assisted: bool = False
    hf_prompt_lookup: bool = False
    # tree / multi-draft configurations (module doc); each entry is checked by tree_entry, which names its key
    trees: list[Any] = field(default_factory=list)
    # any policy by the settings `generate` takes (params.py), one configuration each, checked by the
    # policy's own params class: [{policy: ngram}, {policy: ngram, k: 3}, {policy: ngram, fallback: learned,
    # head: DIR, threshold: auto}]; `label` names the configuration in the report (default: its settings)
    policies: list[Any] = field(default_factory=list)
    tree_calibration_prompts: int = 2  # per dataset: prompts the tree acceptance rates are measured on
    tree_calibration_width: int = 8  # siblings of the calibration's batch drafting
    # running
    warmup: bool = True  # one short untimed generation per kind before the first timed run
    out_dir: str = ""  # default runs/sweep/<name>, relative to the project root
    overwrite: bool = False  # discard results of other settings found in out_dir (same settings: resumed)
    progress: bool = True

    def validate(self):
        if not self.datasets or not all(isinstance(d, str) and d.strip() for d in self.datasets):
            raise UserError("config key 'datasets' must be a non-empty list of dataset names or paths")
        if len(set(self.datasets)) != len(self.datasets):
            raise UserError(f"config key 'datasets' lists a dataset twice: {self.datasets}")
        for key in ("fields", "hf_configs", "hf_splits"):
            d = getattr(self, key)
            if not isinstance(d, dict):
                raise UserError(f"config key '{key}' must be a mapping dataset: value, got {d!r}")
            stray = sorted(set(d) - set(self.datasets))
            if stray:
                raise UserError(f"config key '{key}' names dataset(s) {', '.join(map(repr, stray))} that are not in "
                                f"datasets ({', '.join(self.datasets)})")
        for key in ("n_prompts", "max_new_tokens", "max_prompt_tokens", "k_max", "tree_calibration_prompts",
                    "tree_calibration_width"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        typed = policy_specs(self)
        if self.pair.draft is None and self.needs_draft(typed):
            raise UserError("pair.draft is none, but the grid drafts with a draft model (ks, heads, taus, heuristic, "
                            "oracle, trees, include_draft_ar or a policy that uses one): name a draft model (default: "
                            "the default pair's), or keep only ar and policies without one (ngram)")
        engine = self.pair.engine
        for key, need in (("hf_assisted", "hf_generate"), ("hf_prompt_lookup", "hf_generate"), ("trees", "tree")):
            if getattr(self, key) and need not in engine.capabilities:
                raise UserError(f"{key} needs {engines.CAPABILITIES[need]}, which the {engine.name} backend does not "
                                f"give; set it off for pair.backend {engine.name}, or use backend torch")
        for spec in typed:
            try:
                check_runs_on(spec.params["settings_obj"], engine)
            except UserError as e:
                raise UserError(f"policies: {e}") from None
        SamplingParams(self.temperature, self.top_k, self.top_p)
        self.ks = [_auto_or(k, int, "ks") for k in self.ks]
        for k in self.ks:
            if k != AUTO and k < 1:
                raise UserError(f"every K in ks must be an integer >= 1 or auto, got {k!r}")
        self.thresholds = [_auto_or(h, float, "thresholds") for h in self.thresholds]
        for h in self.thresholds:
            if h != AUTO and not 0.0 < h < 1.0:
                raise UserError(f"every SpecDec++ threshold h must be in (0, 1) or auto, got {h!r} in thresholds")
        if AUTO in self.ks and not (self.curve or self.heads):
            raise UserError("ks lists auto but neither curve nor heads is given: set curve to a threshold_curve.json "
                            "(made by `adaptive-spec autotune`), or list a head that has one")
        for tau in self.confidence_taus:
            if not 0.0 < tau < 1.0:
                raise UserError(f"every confidence threshold must be in (0, 1), got {tau!r} in confidence_taus")
        for tau in self.entropy_taus:
            if not tau > 0.0:
                raise UserError(f"every entropy threshold must be > 0 nats, got {tau!r} in entropy_taus")
        if self.heads and not self.thresholds:
            raise UserError("heads are given but thresholds is empty; list the h values to sweep")
        tree_specs(self)

    def needs_draft(self, typed: list | None = None) -> bool:
        return bool(self.include_draft_ar or self.ks or self.heads or self.confidence_taus or self.entropy_taus
                    or self.heuristic or self.oracle or self.hf_assisted or self.trees
                    or any(s.params["settings_obj"].uses_draft for s in (typed if typed is not None
                                                                         else policy_specs(self))))

    def resolved_out_dir(self) -> Path:
        return project_path(self.out_dir or f"runs/sweep/{self.name or 'sweep'}")


AUTO = "auto"


def _auto_or(value, kind, key: str):
    """`auto`, or the value as `kind` (a YAML or key=value list may hold numbers as strings)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        if kind is int and (isinstance(value, bool) or float(value) != int(float(value))):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise UserError(f"config key '{key}' takes {'integers' if kind is int else 'numbers'} or auto, "
                        f"got {value!r}") from None


def _fmt(v) -> str:
    return v if v == AUTO else f"{v:g}"


# ----------------------------------------------------------------------------- the grid

@dataclass
class RunSpec:
    key: str  # unique within a sweep, e.g. "fixed:k=4", "learned:head=d3-wrej6:h=0.7"
    method: str  # ar | draft_ar | fixed | learned | confidence | entropy | heuristic | oracle | hf_assisted,
    #              or one of TREE_POLICIES
    params: dict = field(default_factory=dict)  # k, head, h, tau; a tree entry's keys

    def row_fields(self) -> dict:
        row = {"config": self.key, "method": self.method, "k": self.params.get("k"),
               "head": self.params.get("head"), "h": self.params.get("h"), "tau": self.params.get("tau")}
        if "settings" in self.params:  # a `policies` entry: its settings as given
            row["settings"] = self.params["settings"]
        if self.method in TREE_POLICIES:  # node_cost: the value used goes in the row (auto is measured)
            row.update({k: v for k, v in self.params.items() if k not in ("policy", "node_cost")})
        return row


def build_grid(cfg: SweepConfig, head_labels: list[str]) -> tuple[list[RunSpec], list[str]]:
    """The configurations run on every prompt, in run order, and notes on what was left out."""
    specs, notes = [], []
    if cfg.include_ar:
        specs.append(RunSpec("ar", "ar"))
    if cfg.include_draft_ar:
        specs.append(RunSpec("draft_ar", "draft_ar"))
    specs += [RunSpec(f"fixed:k={k}", "fixed_auto" if k == AUTO else "fixed", {"k": k}) for k in dict.fromkeys(cfg.ks)]
    for label in head_labels:
        specs += [RunSpec(f"learned:head={label}:h={_fmt(h)}", "learned_auto" if h == AUTO else "learned",
                          {"head": label, "h": h}) for h in dict.fromkeys(cfg.thresholds)]
    specs += [RunSpec(f"confidence:tau={t:g}", "confidence", {"tau": float(t)}) for t in dict.fromkeys(cfg.confidence_taus)]
    specs += [RunSpec(f"entropy:tau={t:g}", "entropy", {"tau": float(t)}) for t in dict.fromkeys(cfg.entropy_taus)]
    if cfg.heuristic:
        specs.append(RunSpec("heuristic", "heuristic"))
    if cfg.oracle:
        if cfg.temperature > 0:
            notes.append(f"oracle skipped: the hindsight oracle is defined for greedy decoding and this sweep "
                         f"samples at temperature {cfg.temperature:g}")
        else:
            specs.append(RunSpec("oracle", "oracle"))
    if cfg.hf_assisted:
        specs.append(RunSpec("hf_assisted", "hf_assisted"))
    if cfg.hf_prompt_lookup:
        specs.append(RunSpec("hf_prompt_lookup", "hf_prompt_lookup"))
    specs += tree_specs(cfg)
    specs += policy_specs(cfg)
    if not specs:
        raise UserError("the sweep grid is empty; enable include_ar, list ks, heads, ... in the config")
    return specs, notes


MULTI_DRAFT = ("spectr", "batch-sd")
_TREE_KEYS = ("policy", "drafting", "estimator", "budget", "max_budget", "node_cost", "head", "adapt")
_MULTI_KEYS = ("policy", "num_drafts", "k")


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _one_of(values) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1]


def _tree_entry(cfg: SweepConfig, e, at: str, labels) -> dict:
    """One `trees` entry checked, its defaults filled in; a problem names the entry's key (at.key).
    `labels()`: the labels of `heads`, looked up only when an entry names a head."""
    if not isinstance(e, dict):
        raise UserError(f"{at} must be a mapping such as {{policy: tree, budget: 8}}, got {e!r}")
    policy = e.get("policy", "tree")
    if policy not in TREE_POLICIES:
        raise UserError(f"{at}.policy: unknown policy {policy!r}; use {_one_of(TREE_POLICIES)}")
    valid = _MULTI_KEYS if policy in MULTI_DRAFT else _TREE_KEYS
    for key in e:
        if key not in valid:
            raise UserError(f"{at}.{key}: unknown key for policy {policy}; valid keys: {', '.join(valid)}")
    if policy in MULTI_DRAFT:
        d = {"policy": policy, "num_drafts": e.get("num_drafts", 4), "k": e.get("k", 4)}
        for key in ("num_drafts", "k"):
            if not _pos_int(d[key]):
                raise UserError(f"{at}.{key}: must be an integer >= 1, got {d[key]!r}")
        return d
    d = {"policy": policy, "drafting": e.get("drafting", "tree"), "estimator": e.get("estimator", "positional"),
         "budget": e.get("budget", 8), "head": e.get("head"), "adapt": e.get("adapt", False)}
    if not isinstance(d["adapt"], bool):
        raise UserError(f"{at}.adapt: must be true (the per-sibling rates adapt to each run's rounds, starting "
                        f"from the calibrated ones) or false (frozen), got {d['adapt']!r}")
    if d["drafting"] not in DRAFTINGS:
        raise UserError(f"{at}.drafting: unknown drafting {d['drafting']!r}; use {_one_of(DRAFTINGS)}")
    if d["estimator"] not in ("positional", "head"):
        raise UserError(f"{at}.estimator: unknown estimator {d['estimator']!r}; use positional or head")
    if d["estimator"] == "head":
        _check_tree_head(d, at, labels)
    elif d["head"] is not None:
        raise UserError(f"{at}.head: only estimator head reads a head; drop head or set estimator: head")
    if d["budget"] == "learned":
        d["max_budget"] = e.get("max_budget", cfg.k_max)
        d["node_cost"] = e.get("node_cost", "auto")
        if not _pos_int(d["max_budget"]):
            raise UserError(f"{at}.max_budget: must be an integer >= 1 (the most tokens a learned budget drafts "
                            f"per round), got {d['max_budget']!r}")
        c = d["node_cost"]
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf")):
            raise UserError(f"{at}.node_cost: must be a number > 0 (one drafted token's cost in target steps, "
                            f"(t_draft + t_cand) / t_target) or auto (measured on the pair), got {c!r}")
        if d["drafting"] not in NESTED:
            raise UserError(f"{at}.budget: a learned budget grows the tree node by node, which drafting "
                            f"{d['drafting']} cannot; use drafting {_one_of(NESTED)}, or a fixed budget")
    elif not _pos_int(d["budget"]):
        raise UserError(f"{at}.budget: must be an integer >= 1 (tokens drafted per round) or learned (with "
                        f"max_budget as its cap), got {d['budget']!r}")
    else:
        for key in ("max_budget", "node_cost"):
            if key in e:
                raise UserError(f"{at}.{key}: only used with budget: learned; drop it or set budget: learned")
    return d


def _check_tree_head(d: dict, at: str, labels) -> None:
    if d["drafting"] != "tree":
        raise UserError(f"{at}.estimator: the head estimator builds the optimal tree; use it with drafting tree, "
                        "or estimator positional")
    h = d["head"]
    if not h:
        raise UserError(f"{at}.head: estimator head needs an acceptance head; set head to a label of heads "
                        f"({', '.join(labels()) or 'none listed'}) or a head folder, or use estimator positional")
    if not isinstance(h, str):
        raise UserError(f"{at}.head: must be a label of heads or a head folder, got {h!r}")
    p = Path(h).expanduser()
    if h not in labels() and not any(_head_folder(c) for c in ([p] if p.is_absolute() else [p, PROJECT_ROOT / p])):
        raise UserError(f"{at}.head: {h!r} is neither a label of heads ({', '.join(labels()) or 'none listed'}) "
                        "nor a head folder (one with config.json, or a training output dir holding head/)")


def _tree_key(d: dict) -> str:
    if d["policy"] in MULTI_DRAFT:
        return f"{d['policy']}:n={d['num_drafts']}:k={d['k']}"
    est = f"head={d['head']}" if d["estimator"] == "head" else "positional"
    b = d["budget"]
    if b == "learned":
        c = d["node_cost"]
        b = f"learned<={d['max_budget']}:c={c if c == 'auto' else format(c, 'g')}"
    return f"{d['policy']}:{d['drafting']}:{est}:b={b}" + (":adapt" if d["adapt"] else "")


def policy_specs(cfg: SweepConfig) -> list[RunSpec]:
    """One RunSpec per `policies` entry, its settings checked by the policy's params class (a problem
    names the entry: policies[i])."""
    if not isinstance(cfg.policies, list):
        raise UserError(f"config key 'policies' must be a list of mappings such as {{policy: ngram, k: 3}}, "
                        f"got {cfg.policies!r}")
    specs, seen = [], {}
    for i, e in enumerate(cfg.policies):
        if not isinstance(e, dict) or not isinstance(e.get("policy"), str):
            raise UserError(f"policies[{i}] must be a mapping with a policy name, e.g. {{policy: ngram, k: 3}}, "
                            f"got {e!r}")
        settings = {k: v for k, v in e.items() if k not in ("policy", "label")}
        try:
            obj = policy_params(e["policy"], **settings)
        except UserError as err:
            raise UserError(f"policies[{i}]: {err}") from None
        key = str(e.get("label") or ":".join([obj.name] + [f"{k}={v}" for k, v in sorted(settings.items())]))
        if key in seen:
            raise UserError(f"policies[{i}] repeats policies[{seen[key]}] ({key}); drop one or give it a label")
        seen[key] = i
        specs.append(RunSpec(key, obj.name, {"settings": settings, "settings_obj": obj, **{
            k: settings.get(k) for k in ("k", "head")}, "h": settings.get("threshold")}))
    return specs


def tree_specs(cfg: SweepConfig) -> list[RunSpec]:
    """One RunSpec per `trees` entry (checked: a problem raises a UserError naming trees[i].key).
    A head is named by its label in `heads`, or by its folder (then the folder, as written, is its label)."""
    cache = []

    def labels() -> list[str]:
        if not cache:
            cache.append([label for label, _ in resolve_heads(cfg.heads)])
        return cache[0]

    if not isinstance(cfg.trees, list):
        raise UserError(f"config key 'trees' must be a list of mappings, got {cfg.trees!r}")
    specs, seen = [], {}
    for i, e in enumerate(cfg.trees):
        d = _tree_entry(cfg, e, f"trees[{i}]", labels)
        key = _tree_key(d)
        if key in seen:
            raise UserError(f"trees[{i}] repeats trees[{seen[key]}] ({key}); drop one")
        seen[key] = i
        specs.append(RunSpec(key, d["policy"], d))
    return specs


# ----------------------------------------------------------------------------- heads

def _head_folder(p: Path) -> Path | None:
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
            hits: list[Path] = []
            for base in bases:
                hits = [h for h in (_head_folder(Path(m)) for m in sorted(glob.glob(str(base / pat)))) if h]
                if hits:
                    break
            if not hits:
                raise UserError(f"no acceptance head folders match {pat!r}; train one with "
                                "`python train.py --config configs/train/default.yaml` or fix the heads list")
            found += hits
            continue
        p = Path(pat)
        cands = [p] if p.is_absolute() else [p, PROJECT_ROOT / p]
        folder = next((h for h in (_head_folder(c) for c in cands if c.exists()) if h), None)
        found.append(folder if folder is not None else p)  # a missing one fails in from_pretrained
    found = list(dict.fromkeys(f.resolve() if f.exists() else f for f in found))
    labels = [f.parent.name if f.name == "head" else f.name for f in found]
    if len(set(labels)) != len(labels):  # same folder names: fall back to the full paths
        labels = [str(f) for f in found]
    return list(zip(labels, found))


def load_heads(cfg: SweepConfig, hidden_size: int | None, patterns: list[str] | None = None) -> dict:
    """{label: (AcceptanceHead on CPU, info)} of `patterns` (default: `heads`); a head trained for
    another draft is refused here."""
    heads = {}
    for label, folder in resolve_heads(cfg.heads if patterns is None else patterns):
        head = AcceptanceHead.from_pretrained(folder, hidden_size=hidden_size, draft_model=cfg.pair.draft,
                                              dtype=torch.float32)
        extra = dict(head.extra)
        metrics = extra.pop("metrics", None)
        mfile = Path(folder) / "metrics.json"
        if metrics is None and mfile.is_file():
            try:
                metrics = json.loads(mfile.read_text())
            except json.JSONDecodeError:
                metrics = None
        info = {"label": label, "path": str(folder), "depth": head.depth, "hidden_size": head.hidden_size,
                "draft_model": head.draft_model, "w_rej": extra.get("w_rej"), "step": extra.get("step"),
                "metrics": metrics or {}, "extra": {k: v for k, v in extra.items() if k not in ("w_rej", "step")}}
        heads[label] = (head, info)
    return heads


def load_tree_heads(cfg: SweepConfig, heads: dict, specs, hidden_size: int | None) -> dict:
    """`heads` plus the heads the tree configurations name by folder (labelled by the folder as
    written), each checked to be a token head before any model loads."""
    out = dict(heads)
    for spec in specs:
        h = spec.params.get("head") if spec.method in TREE_POLICIES else None
        if h is None:
            continue
        if h not in out:
            (head, info), = load_heads(cfg, hidden_size, [h]).values()
            out[h] = (head, {**info, "label": h})
        feature = getattr(out[h][0], "feature", "token")
        if feature != "token":
            raise UserError(f"trees: head {h} reads feature={feature}, but the tree estimator scores each drafted "
                            "node from its own hidden state and needs a head trained with feature=token")
    return out


def _draft_hidden_size(draft: str) -> int | None:
    """The draft's hidden size from its config.json when it is a local folder (no weights loaded)."""
    try:
        path = Path(resolve_model_path(draft, "draft", auto_fetch=False))
    except UserError:
        return None
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        return None
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    return int(h) if h else None


# ----------------------------------------------------------------------------- results file

def _settings(cfg: SweepConfig, device: str) -> dict:
    p = cfg.pair
    d = {k: UNSET[k] if k in UNSET and getattr(p, k) is None else getattr(p, k) for k in PAIR_RESULT_KEYS}
    d.update(p.model_dump(include=set(PAIR_IF_SET), exclude_defaults=True))
    d.update({k: getattr(cfg, k) for k in RESULT_KEYS})
    d["device"] = device
    return d


def stored_pair(config: dict) -> dict:
    """The pair's settings of a config.json's config: its `pair`, or, where a sweep wrote them before
    they moved there, its top-level keys of the same names."""
    return config.get("pair") or {k: config[k] for k in PairParams.model_fields if k in config}


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


TREE_CALIBRATION = "tree_calibration.json"
COSTS = "costs.json"
RUN_FILES = (RESULTS, "settings.json", "config.json", "heads.json", "prompts.json", TREE_CALIBRATION, COSTS)


def check_out_dir(out: Path, settings: dict, overwrite: bool):
    """Refuse to mix results of different settings in one out_dir; with `overwrite`, discard results of
    other (or unknown) settings instead. Results of the same settings are always resumed."""
    saved = read_json(out / "settings.json", required=False, hint="delete it, or use another out_dir")
    rfile = out / RESULTS
    if saved is not None:
        problem = settings_problem(out, saved.get("settings", {}), settings, "sweep")
    elif rfile.is_file() and rfile.stat().st_size:
        problem = f"{out} holds a {RESULTS} without settings.json, so its settings are unknown"
    else:
        problem = None
    if problem is None:
        return
    if not overwrite:
        raise UserError(f"{problem}; use another out_dir, or overwrite=true to discard them")
    print(f"note: {problem}; overwrite=true: discarding them", file=sys.stderr)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)


def prompt_sha(text) -> str:
    """A prompt's id: its text's hash (a conversation's: its messages' JSON)."""
    text = text if isinstance(text, str) else json.dumps(text, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- running one configuration

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented prompt-lookup setting (it has no default)


def hf_generate(pair, ids: list[int], cfg, seed: int, max_new_tokens: int, lookup: bool = False):
    """transformers' assisted generation (its default candidate schedule), or with `lookup` its prompt
    lookup (n-gram candidates, no draft model), timed like ours: (Metrics, stopped_by, new ids).
    `cfg`: anything with temperature, top_k, top_p (a SweepConfig)."""
    tm = pair.target.model
    counts = {"target": 0, "draft": 0}
    hooks = [tm.register_forward_pre_hook(lambda m, a: counts.__setitem__("target", counts["target"] + 1))]
    if not lookup:
        hooks.append(pair.draft.model.register_forward_pre_hook(
            lambda m, a: counts.__setitem__("draft", counts["draft"] + 1)))
    x = torch.tensor([ids], dtype=torch.long, device=pair.target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=cfg.temperature > 0, repetition_penalty=1.0,
              eos_token_id=list(pair.eos_token_ids),
              pad_token_id=pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None
              else pair.eos_token_ids[0])
    if cfg.temperature > 0:
        kw.update(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        torch.manual_seed(seed)
        peer = ({"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if lookup
                else {"assistant_model": pair.draft.model})
        with torch.inference_mode(), timed(x.device) as t:
            out = tm.generate(x, attention_mask=torch.ones_like(x), **peer, **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
        for h in hooks:
            h.remove()
    new = out[0, len(ids):].tolist()
    n = len(new)
    m = Metrics(n_tokens=n, n_draft_forwards=counts["draft"], n_target_forwards=counts["target"], wall_s=t.s)
    # one target pass per round, one draft pass per candidate: N_draft + N_target = N + N_discarded (prompt
    # lookup drafts without forwards: its discarded candidates are not counted, only those accepted)
    m.n_discarded = 0 if lookup else max(0, m.n_draft_forwards + m.n_target_forwards - n)
    m.n_accepted = max(0, n - m.n_target_forwards)
    m.n_drafted = m.n_accepted + m.n_discarded
    stopped = "eos" if new and new[-1] in set(pair.eos_token_ids) else "length"
    return m, stopped, new


def hf_schedule_note(draft_model) -> str:
    """What transformers' assisted generation will do with this draft (its defaults unless the draft's
    generation_config sets them)."""
    gc = draft_model.generation_config
    defaults = gc._get_default_generation_params() if hasattr(gc, "_get_default_generation_params") else {}
    get = lambda k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k)  # noqa: E731
    adapt = "on" if is_sklearn_available() else "off (transformers adapts it only when scikit-learn is installed)"
    return (f"hf_assisted: num_assistant_tokens {get('num_assistant_tokens')}, schedule "
            f"{get('num_assistant_tokens_schedule')}, assistant_confidence_threshold "
            f"{get('assistant_confidence_threshold')}, threshold adaptation {adapt}")


def run_one(pair, spec: RunSpec, ids: list[int], cfg: SweepConfig, seed: int, heads: dict, draft_decoder,
            max_new_tokens: int | None = None, target_output: list[int] | None = None, tree_ctx: dict | None = None):
    """(Metrics, stopped_by, new token ids, extra row fields) of one configuration on one prompt.
    `target_output`: the target's greedy output on this prompt, when known, for the oracle (saves a
    decode); `tree_ctx`: the calibrated rates and node cost of the tree policies (_tree_context)."""
    mnt = max_new_tokens or cfg.max_new_tokens
    samp = dict(max_new_tokens=mnt, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
    if "settings_obj" in spec.params:  # a `policies` entry: the settings generate takes
        g = pair.generate(ids, policy=spec.params["settings_obj"], **samp)
        pick = getattr(g, "auto", None)
        extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"]} if pick else {}
        return g.metrics, g.stopped_by, g.token_ids, extra
    if spec.method in TREE_POLICIES:
        return _run_tree(pair, spec, ids, samp, heads, tree_ctx or {})
    if spec.method in ("hf_assisted", "hf_prompt_lookup"):
        return (*hf_generate(pair, ids, cfg, seed, mnt, lookup=spec.method == "hf_prompt_lookup"), {})
    if spec.method == "draft_ar":
        g = draft_decoder.generate(ids, max_new_tokens=mnt, seed=seed,
                                   sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p))
        m = g.metrics  # the draft ran as the decoder's "target": move its counts to the draft's fields
        m.n_draft_forwards, m.draft_s = m.n_target_forwards, m.target_s
        m.n_target_forwards, m.target_s = 0, 0.0
        return m, g.stopped_by, g.token_ids, {}
    g = pair.generate(ids, policy=chain_params(spec, cfg, heads, target_output), **samp)
    pick = getattr(g, "auto", None)
    extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"],
             "auto_predicted_wall_tokens_per_s": pick.get("wall_tokens_per_s"),
             "auto_time_model": pick["model"], "auto_k_max": pick.get("k_max")} if pick else {}
    return g.metrics, g.stopped_by, g.token_ids, extra


# a chain configuration's sweep keys -> its policy's settings (params.py); `_auto` reads a curve
_SETTINGS = {
    "ar": lambda p, cfg, heads, x: {},
    "heuristic": lambda p, cfg, heads, x: {"k_max": cfg.k_max},
    "oracle": lambda p, cfg, heads, x: {"target_output": x},
    "fixed": lambda p, cfg, heads, x: {"k": p["k"]},
    "fixed_auto": lambda p, cfg, heads, x: {"k": p["k"], "curve": auto_curve(cfg, heads)},
    "learned": lambda p, cfg, heads, x: {"head": heads[p["head"]][0], "threshold": p["h"], "k_max": cfg.k_max},
    "learned_auto": lambda p, cfg, heads, x: {"head": heads[p["head"]][0], "threshold": p["h"], "k_max": cfg.k_max,
                                              "curve": heads[p["head"]][1]["path"]},
    "confidence": lambda p, cfg, heads, x: {"threshold": p["tau"], "k_max": cfg.k_max},
    "entropy": lambda p, cfg, heads, x: {"threshold": p["tau"], "k_max": cfg.k_max},
}


def chain_params(spec: RunSpec, cfg: SweepConfig, heads: dict, target_output: list[int] | None = None):
    """The typed settings of a chain configuration, built and checked by its policy's registered
    params class: the sweep reaches policies by the names and settings generate uses."""
    return policy_params(spec.method.removesuffix("_auto"), **_SETTINGS[spec.method](spec.params, cfg, heads,
                                                                                       target_output))


def auto_curve(cfg: SweepConfig, heads: dict) -> str:
    """The curve `ks: [auto]` picks from: `curve`, else the one beside the first head."""
    return cfg.curve or next(iter(heads.values()))[1]["path"]


def check_auto_curves(cfg: SweepConfig, heads: dict, specs: list[RunSpec]):
    """Every curve an auto configuration needs exists and fits, checked before the models load;
    the error names the config key and the command that makes the curve."""
    for spec in specs:
        key, need, source = (("thresholds", "h", heads[spec.params["head"]][1]["path"])
                             if spec.method == "learned_auto" else ("ks", "k", auto_curve(cfg, heads))
                             if spec.method == "fixed_auto" else (None, None, None))
        if key:
            try:
                curve = load_curve(source, need, source if need == "h" else None)
            except UserError as e:
                raise UserError(f"config key '{key}' lists auto: {e}") from None
            if need == "h" and curve["k_max"] != cfg.k_max:
                raise UserError(f"config key 'thresholds' lists auto, but the curve beside {source} was made with "
                                f"k_max {curve['k_max']}, not the sweep's k_max {cfg.k_max}; set k_max: "
                                f"{curve['k_max']}, or rerun autotune with --k-max {cfg.k_max}")


def _run_tree(pair, spec: RunSpec, ids: list[int], samp: dict, heads: dict, ctx: dict):
    """run_one for a tree or multi-draft configuration. A fresh policy per run, starting from the
    sweep's calibrated rates, frozen unless the entry says `adapt: true` (then they adapt within the
    run only): no run depends on what ran before it."""
    p = spec.params
    extra = {}
    if spec.method in MULTI_DRAFT:
        kw = {"num_drafts": p["num_drafts"], "k": p["k"]}
    else:
        learned = p["budget"] == "learned"
        kw = {"drafting": p["drafting"], "tree_estimator": p["estimator"],
              "head": heads[p["head"]][0] if p["head"] else None,
              "tree_budget": p["max_budget"] if learned else p["budget"],
              "tree_rates": ctx["rates"][VERIFICATION[spec.method]], "adapt_rates": p["adapt"]}
        extra["tree_calibration"] = ctx.get("calibration")
        if learned:
            extra["node_cost"] = ctx.get("node_cost") if p["node_cost"] == "auto" else float(p["node_cost"])
            kw.update(tree_learned=True, tree_node_cost=extra["node_cost"])
    pol = make_policy(spec.method, PolicyContext(pair), **kw)
    sampling = SamplingParams(samp["temperature"], samp["top_k"], samp["top_p"])
    g = pair.decoder.generate(ids, max_new_tokens=samp["max_new_tokens"], sampling=sampling, policy=pol,
                              seed=samp["seed"])
    return g.metrics, g.stopped_by, g.token_ids, {**tree_stats(pol, g.metrics), **extra}


def tree_stats(pol, m) -> dict:
    """Per-round means of a tree or multi-draft generation: drafted tokens (Metrics), the drafted
    tree's depth and the predicted accepted tokens (sum of R) where the policy keeps them (None
    where it does not)."""
    rounds = sum(m.accepted_hist.values()) or m.n_target_forwards
    n = max(getattr(pol, "rounds", rounds), 1)
    out = {"rounds": rounds, "drafted_per_round": m.n_drafted / max(rounds, 1)}
    for key, stat in (("tree_depth", "depth_sum"), ("predicted_accepted", "predicted")):
        v = getattr(pol, stat, None)
        out[key] = None if v is None else v / n
    return out


# ----------------------------------------------------------------------------- the sweep

def _select_prompts(pair, texts: list[str], cfg: SweepConfig, n: int | None = None,
                    order=None) -> tuple[list[tuple[int, str, list[int]]], int]:
    """The first n (default n_prompts) of the shuffled texts that fit, taken in `order` (indices;
    default: the shuffled order): (index in the shuffled set, text, ids), and how many were skipped."""
    ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
    limit = min([cfg.max_prompt_tokens] + [c - cfg.max_new_tokens for c in ctx])
    chosen, skipped = [], 0
    for i in range(len(texts)) if order is None else order:
        if len(chosen) == (cfg.n_prompts if n is None else n):
            break
        ids = pair.encode(texts[i], cfg.chat)
        if len(ids) > limit:
            skipped += 1
            continue
        chosen.append((i, texts[i], ids))
    return chosen, skipped


def run(cfg: SweepConfig) -> Path:
    """Run (or resume) the sweep; returns the out_dir."""
    # everything that can be checked without the models, first
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    hidden = _draft_hidden_size(cfg.pair.draft)
    heads = load_heads(cfg, hidden)
    specs, notes = build_grid(cfg, list(heads))
    check_auto_curves(cfg, heads, specs)
    all_heads = load_tree_heads(cfg, heads, specs, hidden)
    _note(notes)
    settings = _settings(cfg, _device_name(cfg.pair.device))
    out = cfg.resolved_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, "sweep")  # noqa: F841 (held until this process exits)
    check_out_dir(out, settings, cfg.overwrite)

    pair, draft_decoder = _load_pair(cfg, all_heads)
    if any(s.method == "hf_assisted" for s in specs):
        notes += _note([hf_schedule_note(pair.draft.model)])
    selected = {ds: _select_dataset(pair, ds, texts[ds], cfg, notes) for ds in cfg.datasets}
    costs = _pinned_costs(pair, out, specs, notes)
    tree_ctx = _tree_context(pair, cfg, out, texts, selected, settings, specs, notes, costs)
    cpu_pad_to = _cpu_pad_to(pair)
    runtime = pair.runtime_info()
    _write_run_files(out, cfg, settings, heads, selected, specs, notes, cpu_pad_to, runtime)
    todo, n_jobs = _todo(out / RESULTS, cfg, selected, specs)
    if todo and cfg.warmup:
        _warmup(pair, todo[0][3], specs, cfg, all_heads, draft_decoder, tree_ctx)
    # every row carries the machine and the numeric paths it ran on: "auto" resolves per CPU
    context = {"settings_hash": settings_hash(settings), "cpu_pad_to": cpu_pad_to, "isa": runtime["machine"]["isa"],
               "cpu_flags": runtime["machine"]["cpu_flags"],
               "paths": {r: runtime.get(f"{r}_path") for r in ("target", "draft")}}
    _run_jobs(pair, todo, n_jobs, cfg, all_heads, draft_decoder, out / RESULTS, context, tree_ctx)
    return out


def _note(notes: list[str]) -> list[str]:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return notes


def _device_name(device: str | None) -> str:
    return str(resolve_device(device))


def _load_pair(cfg: SweepConfig, heads: dict):
    """The pair, with every head checked against its draft and moved to its device, and a
    decoder that runs the draft alone (the draft_ar baseline)."""
    hf_logging.disable_progress_bar()
    pair = SpecPair.load(cfg.pair)
    for label, (head, info) in heads.items():
        if head.hidden_size != pair.draft.hidden_size:
            raise UserError(f"head {label} at {info['path']} was trained for a draft of hidden size "
                            f"{head.hidden_size} but the draft in use has hidden size {pair.draft.hidden_size}; "
                            "pass the draft it was trained for or train a head for this draft")
        head.to(pair.draft.device)
    return pair, (Decoder(pair.draft, None, eos_token_ids=pair.eos_token_ids) if pair.draft is not None else None)


def _select_dataset(pair, ds: str, texts: list[str], cfg: SweepConfig, notes: list[str]) -> list:
    """The prompts of one dataset that fit (see _select_prompts); what was skipped goes to `notes`."""
    chosen, skipped = _select_prompts(pair, texts, cfg)
    if not chosen:
        raise UserError(f"no prompt of dataset {ds!r} fits in {cfg.max_prompt_tokens} tokens (and the context "
                        "with max_new_tokens); raise max_prompt_tokens or lower max_new_tokens")
    if skipped:
        notes += _note([f"{ds}: {skipped} prompt(s) longer than the token limit were skipped"])
    if len(chosen) < cfg.n_prompts:
        notes += _note([f"{ds}: only {len(chosen)} prompts (n_prompts = {cfg.n_prompts})"])
    return chosen


def _auto_node_cost(spec: RunSpec) -> bool:
    """A tree with a learned budget whose node cost is measured on this machine (node_cost: auto)."""
    return spec.method in VERIFICATION and "settings" not in spec.params and spec.params.get("node_cost") == "auto"


def _pinned_costs(pair, out: Path, specs, notes: list[str]):
    """The one measurement of t_draft, t_target and t_cand that every auto pick of the sweep reads
    (ks / thresholds auto, a learned tree budget's node_cost auto), pinned in out_dir/costs.json:
    a resumed sweep reuses it, so its auto rows mean the same before and after an interruption.
    None where no configuration needs it."""
    if not any(s.method in ("fixed_auto", "learned_auto") or _auto_node_cost(s) or "settings" in s.params
               for s in specs):
        return None

    costs = measure_costs(pair, pin=out / COSTS)
    table = getattr(costs, "t_verify", ())
    v = f", v(1..{len(table)}) = {' '.join(f'{t / table[0]:.2f}' for t in table)} target steps" if table else ""
    notes += _note([f"auto picks read the forward times pinned in {COSTS}: t_draft/t_target = {costs.c:.4g}{v} "
                    f"(measured {costs.measured})"])
    return costs


def _tree_context(pair, cfg: SweepConfig, out: Path, texts: dict, selected: dict, settings: dict, specs,
                  notes: list[str], costs=None) -> dict:
    """What every tree run shares: {"rates": {gsd|ersd: c_i}, "calibration": its hash, "node_cost"}.
    The rates are measured once (tree_calibration.measure_rates) on prompts no configuration is
    evaluated on: per dataset, tree_calibration_prompts from the END of the shuffled set, so they
    stay the same when n_prompts grows. A learned budget's node_cost auto comes from `costs` (the
    sweep's pinned forward times, _pinned_costs)."""
    methods = sorted({VERIFICATION[s.method] for s in specs if s.method in VERIFICATION and "settings" not in s.params})
    ctx = {"rates": {}, "calibration": None, "node_cost": None}
    if methods:
        prompts = []
        for ds in cfg.datasets:
            used = {i for i, _, _ in selected[ds]}
            order = [i for i in reversed(range(len(texts[ds]))) if i not in used]
            prompts += _select_prompts(pair, texts[ds], cfg, cfg.tree_calibration_prompts, order)[0]
        if not prompts:
            raise UserError("no prompt is left to calibrate the tree policies on: every prompt that fits is "
                            "evaluated; lower n_prompts or add a dataset with more prompts")
        cal_settings = {"sweep": settings_hash(settings), "width": cfg.tree_calibration_width,
                        "prompts": [prompt_sha(t) for _, t, _ in prompts], "vocab_size": pair.target.vocab_size}
        _check_calibration(out, cal_settings)
        sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        cal = load_or_calibrate(out / TREE_CALIBRATION, cal_settings, methods, lambda m: measure_rates(
            pair, [ids for _, _, ids in prompts], sampling, cfg.max_new_tokens, m, cfg.tree_calibration_width,
            progress=cfg.progress))
        ctx.update(rates={m: cal[m]["cond_rates"] for m in methods}, calibration=settings_hash(cal_settings))
        notes += _note([f"tree acceptance rates c_i ({m}, {len(prompts)} calibration prompts): "
                        f"{[round(c, 3) for c in cal[m]['cond_rates'][:6]]}" for m in methods])
    if any(_auto_node_cost(s) for s in specs):
        ctx["node_cost"] = costs.node_cost
        notes += _note([f"tree node_cost auto = (t_draft + t_cand) / t_target = {costs.node_cost:.4g} "
                        f"(t_draft/t_target = {costs.c:.4g}; {costs.measured})"])
    return ctx


def _check_calibration(out: Path, cal_settings: dict) -> None:
    """Tree rows already in results.jsonl ran with the rates of tree_calibration.json: measuring new
    ones under other settings would mix two calibrations in one comparison."""
    saved = read_json(out / TREE_CALIBRATION, required=False, hint="delete it to recalibrate")
    if not saved or saved.get("settings") == cal_settings:
        return
    if settings_hash(saved.get("settings", {})) not in {r.get("tree_calibration") for r in read_jsonl(out / RESULTS)}:
        return  # no row used the saved calibration: it is simply replaced
    problem = settings_problem(out / TREE_CALIBRATION, saved.get("settings", {}), cal_settings, "tree calibration")
    raise UserError(f"{problem}, and the tree rows in {RESULTS} used it; restore datasets, tree_calibration_prompts "
                    "and tree_calibration_width, or use another out_dir")


def _cpu_pad_to(pair) -> dict:
    # the CPU padding is measured at each load, so a resumed sweep may run with another one:
    # config.json has this run's, and every row carries the one it ran with
    return {role: list(getattr(m.model, "cpu_pad_to", ())) for role, m in
            (("target", pair.target), ("draft", pair.draft)) if m is not None}


def _write_run_files(out: Path, cfg: SweepConfig, settings: dict, heads: dict, selected: dict, specs, notes,
                     cpu_pad_to: dict, pair_runtime: dict):
    """settings.json, heads.json, prompts.json and config.json (see the module doc)."""
    write_json(out / "settings.json", {"settings": settings, "hash": settings_hash(settings)})
    write_json(out / "heads.json", {k: v[1] for k, v in heads.items()}, default=str)
    write_json(out / "prompts.json", {ds: [{"prompt_idx": i, "prompt_sha": prompt_sha(t), "n_prompt_tokens": len(ids),
                                            "text": t} for i, t, ids in chosen] for ds, chosen in selected.items()},
               indent=1)
    write_json(out / "config.json", {
        "config": config_to_dict(cfg), "grid": [s.key for s in specs], "notes": notes, "device": settings["device"],
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_pad_to": cpu_pad_to, "runtime": pair_runtime, "written": time.strftime("%Y-%m-%d %H:%M:%S")}, default=str)


def _todo(rpath: Path, cfg: SweepConfig, selected: dict, specs) -> tuple[list[tuple], int]:
    """The (dataset, prompt_idx, text, ids, spec) runs not yet in results.jsonl, and the number of
    runs in all. Prompt-major and round-robin over datasets: a sweep stopped early (or still
    running) has every config on the same prompts and every dataset about equally far along, so
    its partial results already compare side by side."""
    done = {(r.get("dataset"), r.get("prompt_idx"), r.get("prompt_sha"), r.get("config"))
            for r in read_jsonl(rpath, repair=True)}
    jobs = [(ds, *selected[ds][rank], s) for rank in range(max(len(v) for v in selected.values()))
            for ds in cfg.datasets if rank < len(selected[ds]) for s in specs]
    return [j for j in jobs if (j[0], j[1], prompt_sha(j[2]), j[4].key) not in done], len(jobs)


def _run_jobs(pair, todo: list[tuple], n_jobs: int, cfg: SweepConfig, heads: dict, draft_decoder, rpath: Path,
              context: dict, tree_ctx: dict | None = None):
    """Run each job and append its row to results.jsonl as soon as it is done."""
    bar = tqdm(total=n_jobs, initial=n_jobs - len(todo), desc="sweep", unit="run", dynamic_ncols=True,
               disable=not cfg.progress, file=sys.stderr)
    greedy_x = {}  # (dataset, prompt) -> the target-alone greedy output, the oracle's X (Theorem 4.1)
    keep_x = any(j[4].method == "oracle" for j in todo)  # build_grid adds the oracle only when greedy
    try:
        for ds, i, text, ids, spec in todo:
            seed = cfg.seed * 100_003 + i
            x = greedy_x.pop((ds, i), None) if spec.method == "oracle" else None
            m, stopped, new, extra = run_one(pair, spec, ids, cfg, seed, heads, draft_decoder, target_output=x,
                                             tree_ctx=tree_ctx)
            if spec.method == "ar" and keep_x:
                greedy_x[(ds, i)] = new
            append_jsonl(rpath, {"dataset": ds, "prompt_idx": i, "prompt_sha": prompt_sha(text),
                                 "n_prompt_tokens": len(ids), **spec.row_fields(), "seed": seed, "stopped_by": stopped,
                                 "output_sha": prompt_sha(json.dumps(new)), **m.to_dict(), **extra,
                                 "counts_derived": spec.method in ("hf_assisted", "hf_prompt_lookup"), **context,
                                 "time": time.time()})
            bar.update(1)
            bar.set_postfix_str(f"{Path(ds).stem} #{i} {spec.key} {m.tokens_per_s:.1f} tok/s", refresh=False)
    finally:
        bar.close()


def _warmup(pair, ids, specs, cfg, heads, draft_decoder, tree_ctx=None):
    """Untimed short generations: the first forwards pay for allocation and kernel selection."""
    n = min(8, cfg.max_new_tokens)
    seen = set()
    for spec in specs:
        if spec.method in seen or spec.method == "oracle":
            continue
        seen.add(spec.method)
        run_one(pair, spec, ids, cfg, 0, heads, draft_decoder, max_new_tokens=n, tree_ctx=tree_ctx)


INTERRUPTED = "finished runs are kept in results.jsonl; rerun the same command to resume"


def _main(argv) -> int:
    cfg = config_from_argv(SweepConfig, argv, "adaptive-spec sweep", __doc__.split("\n\n")[0], "sweep")
    out = run(cfg)
    print(f"sweep results in {out / RESULTS}; tables and plots: adaptive-spec report --sweep-dir {out}")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
