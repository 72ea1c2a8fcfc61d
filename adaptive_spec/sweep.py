"""Evaluation sweeps (SpecDec++ section 5, appendix D): every decoding configuration on every prompt.

    adaptive-spec sweep --config configs/sweep/paper.yaml [key=value ...]

For each dataset and each prompt, all configurations run back to back, so machine noise hits them
alike and per-prompt ratios compare like with like:

    ar            target alone (autoregressive; stand-alone t_target)
    draft_ar      draft alone (stand-alone t_draft; its forwards are counted as N_draft)
    fixed k=K     SpecDec with a fixed candidate length, for each K in `ks`
    learned       SpecDec++: each acceptance head in `heads` x each threshold h in `thresholds`
    confidence    stop when q(y_i) < tau, for each tau in `confidence_taus`
    entropy       stop when H(q_i) > tau nats, for each tau in `entropy_taus`
    heuristic     transformers' +2/-1 schedule (when `heuristic`)
    oracle        the greedy hindsight oracle of Theorem 4.1 (when `oracle`; temperature 0 only)
    hf_assisted   the peer: transformers' own `target.generate(..., assistant_model=draft)` with its
                  default schedule (when `hf_assisted`); counts from forward hooks, N_discarded
                  derived as N_draft + N_target - N

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

from .config import config_from_argv, config_to_dict
from .errors import UserError, run_main
from .prompts import load_prompts
from .runs import PROJECT_ROOT, append_jsonl, lock_dir, project_path, read_json, read_jsonl, settings_problem, write_json

RESULTS = "results.jsonl"
# config keys that change the numbers in results.jsonl; a resume must keep them
RESULT_KEYS = ("draft", "target", "dtype", "draft_quant", "draft_vocab", "device", "threads", "max_new_tokens",
               "temperature", "top_k", "top_p", "chat", "seed", "k_max", "max_prompt_tokens")


@dataclass
class SweepConfig:
    name: str = ""  # names the default out_dir runs/sweep/<name>; defaults to the config file's stem
    # models
    draft: str = "default"
    target: str = "default"
    dtype: str = "auto"  # auto: bf16, or fp32 on CPUs without bf16 kernels (AVX2); rows record what ran
    draft_quant: str = "none"  # none | int8: weight-only int8 draft (exactness unchanged)
    draft_vocab: str = ""  # "" = all; N | FILE | FILE:N: the draft's output layer keeps those tokens
    device: str | None = None  # None / auto: cuda if available
    threads: int = 0  # torch CPU threads; 0 = torch's default
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
    ks: list[int] = field(default_factory=lambda: list(range(1, 15)))
    heads: list[str] = field(default_factory=list)  # head folders (or training output dirs with head/); globs ok
    thresholds: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    k_max: int = 20  # hard cap on candidates per round for the adaptive policies (paper: 20)
    confidence_taus: list[float] = field(default_factory=list)
    entropy_taus: list[float] = field(default_factory=list)
    heuristic: bool = False
    oracle: bool = False  # greedy only; skipped with a note when temperature > 0
    include_ar: bool = True
    include_draft_ar: bool = True
    hf_assisted: bool = False
    # running
    warmup: bool = True  # one short untimed generation per kind before the first timed run
    out_dir: str = ""  # default runs/sweep/<name>, relative to the project root
    overwrite: bool = False  # discard results of other settings found in out_dir (same settings: resumed)
    progress: bool = True

    def validate(self):
        from .sampling import SamplingParams

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
        for key in ("n_prompts", "max_new_tokens", "max_prompt_tokens", "k_max"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.threads < 0:
            raise UserError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        SamplingParams(self.temperature, self.top_k, self.top_p)
        for k in self.ks:
            if not isinstance(k, int) or k < 1:
                raise UserError(f"every K in ks must be an integer >= 1, got {k!r}")
        for h in self.thresholds:
            if not 0.0 < h < 1.0:
                raise UserError(f"every SpecDec++ threshold h must be in (0, 1), got {h!r} in thresholds")
        for tau in self.confidence_taus:
            if not 0.0 < tau < 1.0:
                raise UserError(f"every confidence threshold must be in (0, 1), got {tau!r} in confidence_taus")
        for tau in self.entropy_taus:
            if not tau > 0.0:
                raise UserError(f"every entropy threshold must be > 0 nats, got {tau!r} in entropy_taus")
        if self.heads and not self.thresholds:
            raise UserError("heads are given but thresholds is empty; list the h values to sweep")

    def resolved_out_dir(self) -> Path:
        return project_path(self.out_dir or f"runs/sweep/{self.name or 'sweep'}")


# ----------------------------------------------------------------------------- the grid

@dataclass
class RunSpec:
    key: str  # unique within a sweep, e.g. "fixed:k=4", "learned:head=d3-wrej6:h=0.7"
    method: str  # ar | draft_ar | fixed | learned | confidence | entropy | heuristic | oracle | hf_assisted
    params: dict = field(default_factory=dict)  # k, head, h, tau

    def row_fields(self) -> dict:
        return {"config": self.key, "method": self.method, "k": self.params.get("k"),
                "head": self.params.get("head"), "h": self.params.get("h"), "tau": self.params.get("tau")}


def build_grid(cfg: SweepConfig, head_labels: list[str]) -> tuple[list[RunSpec], list[str]]:
    """The configurations run on every prompt, in run order, and notes on what was left out."""
    specs, notes = [], []
    if cfg.include_ar:
        specs.append(RunSpec("ar", "ar"))
    if cfg.include_draft_ar:
        specs.append(RunSpec("draft_ar", "draft_ar"))
    specs += [RunSpec(f"fixed:k={k}", "fixed", {"k": k}) for k in dict.fromkeys(cfg.ks)]
    for label in head_labels:
        specs += [RunSpec(f"learned:head={label}:h={h:g}", "learned", {"head": label, "h": float(h)})
                  for h in dict.fromkeys(cfg.thresholds)]
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
    if not specs:
        raise UserError("the sweep grid is empty; enable include_ar, list ks, heads, ... in the config")
    return specs, notes


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


def load_heads(cfg: SweepConfig, hidden_size: int | None) -> dict:
    """{label: (AcceptanceHead on CPU, info)}; a head trained for another draft is refused here."""
    import torch

    from .heads import AcceptanceHead

    heads = {}
    for label, folder in resolve_heads(cfg.heads):
        head = AcceptanceHead.from_pretrained(folder, hidden_size=hidden_size, draft_model=cfg.draft,
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


def _draft_hidden_size(draft: str) -> int | None:
    """The draft's hidden size from its config.json when it is a local folder (no weights loaded)."""
    from .models import resolve_model_path

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
    d = {k: getattr(cfg, k) for k in RESULT_KEYS}
    d["device"] = device
    return d


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


RUN_FILES = (RESULTS, "settings.json", "config.json", "heads.json", "prompts.json")


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


def prompt_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- running one configuration

def _hf_assisted(pair, ids: list[int], cfg: SweepConfig, seed: int, max_new_tokens: int):
    """transformers' assisted generation (its default candidate schedule), timed like ours."""
    import torch
    from transformers.utils import logging as hf_logging

    from .decoding import Metrics
    from .timing import timed

    tm, dm = pair.target.model, pair.draft.model
    counts = {"target": 0, "draft": 0}
    hooks = [tm.register_forward_pre_hook(lambda m, a: counts.__setitem__("target", counts["target"] + 1)),
             dm.register_forward_pre_hook(lambda m, a: counts.__setitem__("draft", counts["draft"] + 1))]
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
        with torch.inference_mode(), timed(x.device) as t:
            out = tm.generate(x, attention_mask=torch.ones_like(x), assistant_model=dm, **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
        for h in hooks:
            h.remove()
    new = out[0, len(ids):].tolist()
    n = len(new)
    m = Metrics(n_tokens=n, n_draft_forwards=counts["draft"], n_target_forwards=counts["target"], wall_s=t.s)
    # one target pass per round, one draft pass per candidate: N_draft + N_target = N + N_discarded
    m.n_discarded = max(0, m.n_draft_forwards + m.n_target_forwards - n)
    m.n_accepted = max(0, n - m.n_target_forwards)
    m.n_drafted = m.n_accepted + m.n_discarded
    stopped = "eos" if new and new[-1] in set(pair.eos_token_ids) else "length"
    return m, stopped, new


def hf_schedule_note(draft_model) -> str:
    """What transformers' assisted generation will do with this draft (its defaults unless the draft's
    generation_config sets them)."""
    from transformers.utils import is_sklearn_available

    gc = draft_model.generation_config
    defaults = gc._get_default_generation_params() if hasattr(gc, "_get_default_generation_params") else {}
    get = lambda k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k)  # noqa: E731
    adapt = "on" if is_sklearn_available() else "off (transformers adapts it only when scikit-learn is installed)"
    return (f"hf_assisted: num_assistant_tokens {get('num_assistant_tokens')}, schedule "
            f"{get('num_assistant_tokens_schedule')}, assistant_confidence_threshold "
            f"{get('assistant_confidence_threshold')}, threshold adaptation {adapt}")


def run_one(pair, spec: RunSpec, ids: list[int], cfg: SweepConfig, seed: int, heads: dict, draft_decoder,
            max_new_tokens: int | None = None, target_output: list[int] | None = None):
    """(Metrics, stopped_by, new token ids) of one configuration on one prompt. `target_output`:
    the target's greedy output on this prompt, when known, for the oracle (saves a decode)."""
    from .sampling import SamplingParams

    mnt = max_new_tokens or cfg.max_new_tokens
    samp = dict(max_new_tokens=mnt, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
    p = spec.params
    if spec.method == "hf_assisted":
        return _hf_assisted(pair, ids, cfg, seed, mnt)
    if spec.method == "draft_ar":
        g = draft_decoder.generate(ids, max_new_tokens=mnt, seed=seed,
                                   sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p))
        m = g.metrics  # the draft ran as the decoder's "target": move its counts to the draft's fields
        m.n_draft_forwards, m.draft_s = m.n_target_forwards, m.target_s
        m.n_target_forwards, m.target_s = 0, 0.0
        return m, g.stopped_by, g.token_ids
    if spec.method in ("ar", "heuristic", "oracle"):
        kw = {"k_max": cfg.k_max} if spec.method == "heuristic" else {}
        if spec.method == "oracle":
            kw["target_output"] = target_output
        g = pair.generate(ids, policy=spec.method, **samp, **kw)
    elif spec.method == "fixed":
        g = pair.generate(ids, policy="fixed", k=p["k"], **samp)
    elif spec.method == "learned":
        g = pair.generate(ids, policy="learned", head=heads[p["head"]][0], threshold=p["h"], k_max=cfg.k_max, **samp)
    elif spec.method in ("confidence", "entropy"):
        g = pair.generate(ids, policy=spec.method, threshold=p["tau"], k_max=cfg.k_max, **samp)
    else:  # pragma: no cover - build_grid makes only the methods above
        raise ValueError(spec.method)
    return g.metrics, g.stopped_by, g.token_ids


# ----------------------------------------------------------------------------- the sweep

def _select_prompts(pair, texts: list[str], cfg: SweepConfig) -> tuple[list[tuple[int, str, list[int]]], int]:
    """The first n_prompts of the shuffled texts that fit: (index in the shuffled set, text, ids), skipped."""
    ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
    limit = min([cfg.max_prompt_tokens] + [c - cfg.max_new_tokens for c in ctx])
    chosen, skipped = [], 0
    for i, text in enumerate(texts):
        if len(chosen) == cfg.n_prompts:
            break
        ids = pair.encode(text, cfg.chat)
        if len(ids) > limit:
            skipped += 1
            continue
        chosen.append((i, text, ids))
    return chosen, skipped


def run(cfg: SweepConfig) -> Path:
    """Run (or resume) the sweep; returns the out_dir."""
    # everything that can be checked without the models, first
    texts = {ds: load_prompts(ds, cfg.fields.get(ds), None, cfg.seed, cfg.hf_configs.get(ds), cfg.hf_splits.get(ds))
             for ds in cfg.datasets}
    heads = load_heads(cfg, _draft_hidden_size(cfg.draft))
    specs, notes = build_grid(cfg, list(heads))
    _note(notes)
    settings = _settings(cfg, _device_name(cfg.device))
    out = cfg.resolved_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, "sweep")  # noqa: F841 (held until this process exits)
    check_out_dir(out, settings, cfg.overwrite)

    pair, draft_decoder = _load_pair(cfg, heads)
    if any(s.method == "hf_assisted" for s in specs):
        notes += _note([hf_schedule_note(pair.draft.model)])
    selected = {ds: _select_dataset(pair, ds, texts[ds], cfg, notes) for ds in cfg.datasets}
    cpu_pad_to = _cpu_pad_to(pair)
    runtime = pair.runtime_info()
    _write_run_files(out, cfg, settings, heads, selected, specs, notes, cpu_pad_to, runtime)
    todo, n_jobs = _todo(out / RESULTS, cfg, selected, specs)
    if todo and cfg.warmup:
        _warmup(pair, todo[0][3], specs, cfg, heads, draft_decoder)
    # every row carries the machine and the numeric paths it ran on: "auto" resolves per CPU
    context = {"settings_hash": settings_hash(settings), "cpu_pad_to": cpu_pad_to, "isa": runtime["machine"]["isa"],
               "cpu_flags": runtime["machine"]["cpu_flags"],
               "paths": {r: runtime.get(f"{r}_path") for r in ("target", "draft")}}
    _run_jobs(pair, todo, n_jobs, cfg, heads, draft_decoder, out / RESULTS, context)
    return out


def _note(notes: list[str]) -> list[str]:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return notes


def _device_name(device: str | None) -> str:
    from .models import resolve_device

    return str(resolve_device(device))


def _load_pair(cfg: SweepConfig, heads: dict):
    """The pair, with every head checked against its draft and moved to its device, and a
    decoder that runs the draft alone (the draft_ar baseline)."""
    from transformers.utils import logging as hf_logging

    from .decoding import Decoder
    from .pipeline import SpecPair

    hf_logging.disable_progress_bar()
    pair = SpecPair.load(target=cfg.target, draft=cfg.draft, dtype=cfg.dtype, device=cfg.device,
                         num_threads=cfg.threads or None, draft_quant=cfg.draft_quant,
                         draft_vocab=cfg.draft_vocab or None)
    for label, (head, info) in heads.items():
        if head.hidden_size != pair.draft.hidden_size:
            raise UserError(f"head {label} at {info['path']} was trained for a draft of hidden size "
                            f"{head.hidden_size} but the draft in use has hidden size {pair.draft.hidden_size}; "
                            "pass the draft it was trained for or train a head for this draft")
        head.to(pair.draft.device)
    return pair, Decoder(pair.draft, None, eos_token_ids=pair.eos_token_ids)


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


def _cpu_pad_to(pair) -> dict:
    # the CPU padding is measured at each load, so a resumed sweep may run with another one:
    # config.json has this session's, and every row carries the one it ran with
    return {role: list(getattr(m.model, "cpu_pad_to", ())) for role, m in
            (("target", pair.target), ("draft", pair.draft)) if m is not None}


def _write_run_files(out: Path, cfg: SweepConfig, settings: dict, heads: dict, selected: dict, specs, notes,
                     cpu_pad_to: dict, pair_runtime: dict):
    """settings.json, heads.json, prompts.json and config.json (see the module doc)."""
    import torch
    import transformers

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
              context: dict):
    """Run each job and append its row to results.jsonl as soon as it is done."""
    from tqdm import tqdm

    bar = tqdm(total=n_jobs, initial=n_jobs - len(todo), desc="sweep", unit="run", dynamic_ncols=True,
               disable=not cfg.progress, file=sys.stderr)
    greedy_x = {}  # (dataset, prompt) -> the target-alone greedy output, the oracle's X (Theorem 4.1)
    keep_x = any(j[4].method == "oracle" for j in todo)  # build_grid adds the oracle only when greedy
    try:
        for ds, i, text, ids, spec in todo:
            seed = cfg.seed * 100_003 + i
            x = greedy_x.pop((ds, i), None) if spec.method == "oracle" else None
            m, stopped, new = run_one(pair, spec, ids, cfg, seed, heads, draft_decoder, target_output=x)
            if spec.method == "ar" and keep_x:
                greedy_x[(ds, i)] = new
            append_jsonl(rpath, {"dataset": ds, "prompt_idx": i, "prompt_sha": prompt_sha(text),
                                 "n_prompt_tokens": len(ids), **spec.row_fields(), "seed": seed, "stopped_by": stopped,
                                 "output_sha": prompt_sha(json.dumps(new)), **m.to_dict(),
                                 "counts_derived": spec.method == "hf_assisted", **context, "time": time.time()})
            bar.update(1)
            bar.set_postfix_str(f"{Path(ds).stem} #{i} {spec.key} {m.tokens_per_s:.1f} tok/s", refresh=False)
    finally:
        bar.close()


def _warmup(pair, ids, specs, cfg, heads, draft_decoder):
    """Untimed short generations: the first forwards pay for allocation and kernel selection."""
    n = min(8, cfg.max_new_tokens)
    seen = set()
    for spec in specs:
        if spec.method in seen or spec.method == "oracle":
            continue
        seen.add(spec.method)
        run_one(pair, spec, ids, cfg, 0, heads, draft_decoder, max_new_tokens=n)


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
