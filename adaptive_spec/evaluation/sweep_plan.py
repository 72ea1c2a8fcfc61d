"""A sweep's plan: its config (SweepConfig) turned, before any model loads, into what each stage of the sweep takes
(sweep.py runs them): the grid, the pairs to load and the heads they run (loaded on the CPU and checked here), the
prompts to pick from, what every run shares, the out_dir and what it records, and what is measured once. Part of
`adaptive-spec sweep`; no later stage reads the config itself."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends.paths import FeatureDraft, resolve_model_path
from ..backends.runner import resolve_device
from ..config import config_to_dict
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..heads.head import AcceptanceHead
from ..params import PairParams
from ..prompts import load_prompts
from ..runs import project_path
from .sweep_calibration import Measures, auto_node_cost, reads_costs, verification
from .sweep_config import SweepConfig
from .sweep_files import FolderPlan
from .sweep_grid import Baseline, Configuration, Source, build_grid
from .sweep_run import RunSettings

# config keys that change the numbers in results.jsonl; a resume must keep them (with the pair's, settings_of)
RESULT_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "chat", "seed", "k_max", "max_prompt_tokens")
# the pair's settings in settings.json, which keeps them flat and spells unset ones as it always has
PAIR_RESULT_KEYS = ("backend", "n_ctx", "draft", "target", "dtype", "draft_quant", "draft_vocab", "threads")
UNSET = {"n_ctx": 0, "draft_vocab": "", "threads": 0}
# torch settings a sweep may set: recorded only when set, so an existing sweep's settings hash holds
PAIR_IF_SET = ("kv_cache", "runtime", "max_cache_len", "target_quant", "draft_context")


@dataclass(frozen=True)
class PromptPicker:
    """Which prompts a sweep takes: per dataset the first n_prompts of its shuffled texts that fit in
    max_prompt_tokens and, with max_new_tokens, in both models' context, as the pair encodes them; and
    `calibration` more per dataset, none evaluated, for the tree policies' rates (0: none)."""

    texts: dict  # dataset -> its shuffled texts
    max_prompt_tokens: int
    max_new_tokens: int
    chat: bool
    n_prompts: int
    calibration: int

    def choose(self, pair, note) -> tuple[dict, list]:
        """(dataset -> [(index in the shuffled set, text, ids)], the calibration prompts); what was skipped goes
        to `note`. The calibration prompts come from the END of each shuffled set, so they stay the same when
        n_prompts grows."""
        selected = {ds: self._dataset(pair, ds, note) for ds in self.texts}
        if not self.calibration:
            return selected, []
        prompts = []
        for ds, chosen in selected.items():
            used = {i for i, _, _ in chosen}
            order = [i for i in reversed(range(len(self.texts[ds]))) if i not in used]
            prompts += self._pick(pair, self.texts[ds], self.calibration, order)[0]
        return selected, prompts

    def _pick(self, pair, texts: list[str], n: int, order=None) -> tuple[list[tuple[int, str, list[int]]], int]:
        """The first n of the texts that fit, taken in `order` (indices; default: the shuffled order), and how
        many were skipped."""
        ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
        limit = min([self.max_prompt_tokens] + [c - self.max_new_tokens for c in ctx])
        chosen, skipped = [], 0
        for i in range(len(texts)) if order is None else order:
            if len(chosen) == n:
                break
            ids = pair.encode(texts[i], self.chat)
            if len(ids) > limit:
                skipped += 1
                continue
            chosen.append((i, texts[i], ids))
        return chosen, skipped

    def _dataset(self, pair, ds: str, note) -> list:
        chosen, skipped = self._pick(pair, self.texts[ds], self.n_prompts)
        if not chosen:
            raise UserError(f"no prompt of dataset {ds!r} fits in {self.max_prompt_tokens} tokens (and the context "
                            "with max_new_tokens); raise max_prompt_tokens or lower max_new_tokens")
        if skipped:
            note(f"{ds}: {skipped} prompt(s) longer than the token limit were skipped")
        if len(chosen) < self.n_prompts:
            note(f"{ds}: only {len(chosen)} prompts (n_prompts = {self.n_prompts})")
        return chosen


@dataclass(frozen=True)
class SweepPlan:
    grid: list[Configuration]  # run on every prompt, in run order
    pairs: dict[str, PairParams]  # drafts entry ("" without a drafts axis) -> the pair to load
    heads: dict  # label (or a trees entry's folder as written) -> (AcceptanceHead on the CPU, info)
    prompts: PromptPicker
    run: RunSettings
    folder: FolderPlan
    measures: Measures
    notes: tuple[str, ...]  # what the grid left out (config.json's notes)

    @property
    def hf_assisted(self) -> bool:
        return any(c.policy is Baseline.HF_ASSISTED for c in self.grid)


def plan_sweep(cfg: SweepConfig) -> SweepPlan:
    """The sweep's plan, with everything that can be checked without the models checked (the heads load here, on
    the CPU, and are checked against the draft); prompts are read, the out_dir is neither made nor read yet."""
    cfg.pair.engine.check_available(cfg.pair.device, "pair.device")
    settings = settings_of(cfg)
    pairs = cfg.draft_pairs()
    grid, listed, notes = build_grid(cfg)
    named = {c.head: c.policy.head for c in grid if c.source is Source.TREES and c.head}
    heads = load_heads(cfg.pair.draft, listed, named)
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    need = Measures(any(map(reads_costs, grid)), tuple(sorted(set(map(verification, grid)) - {None})),
                    any(map(auto_node_cost, grid)), cfg.tree_calibration_width, sampling, cfg.max_new_tokens,
                    cfg.progress)
    run = RunSettings(sampling, cfg.max_new_tokens, cfg.k_max, cfg.seed, cfg.auto_prompts, cfg.curve, cfg.warmup,
                      cfg.progress, cfg.record_trace)
    picker = PromptPicker(texts, cfg.max_prompt_tokens, cfg.max_new_tokens, cfg.chat, cfg.n_prompts,
                          cfg.tree_calibration_prompts if need.methods else 0)
    config = config_to_dict(cfg)
    folder = FolderPlan(project_path(cfg.out_dir or f"runs/sweep/{cfg.name or 'sweep'}"), settings, cfg.overwrite,
                        config, {k: heads[k][1] for k in listed}, cfg.pair if cfg.record_trace else None,
                        bool(cfg.drafts))
    return SweepPlan(grid, pairs, heads, picker, run, folder, need, tuple(notes))


def settings_of(cfg: SweepConfig, device: str | None = None) -> dict:
    """settings.json's settings; `device`: the one the pair runs on (default: resolved from pair.device)."""
    p = cfg.pair
    raw = {k: str(v) if isinstance(v := getattr(p, k), FeatureDraft) else v  # a feature drafter as written
           for k in PAIR_RESULT_KEYS}
    d = {k: UNSET[k] if k in UNSET and v is None else v for k, v in raw.items()}
    d.update(p.model_dump(include=set(PAIR_IF_SET), exclude_defaults=True))
    d.update({k: getattr(cfg, k) for k in RESULT_KEYS})
    if cfg.drafts:  # recorded only when set, so an existing sweep's settings hash holds
        d["drafts"] = list(cfg.drafts)
    if cfg.record_trace:  # likewise; and a resume must not mix rows with and without traces
        d["record_trace"] = True
    if cfg.auto_prompts:  # likewise: auto's picks come from those prompts' curve
        d["auto_prompts"] = cfg.auto_prompts
    d["device"] = device or str(resolve_device(p.device))
    return d


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
    if not (path / "config.json").is_file():
        return None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError:
        return None
    h = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    return int(h) if h else None
