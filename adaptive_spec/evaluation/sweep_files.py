"""A sweep's out_dir: the files it writes (the module doc of sweep.py lists them), the settings its results
depend on, and the checks that keep one out_dir to one set of settings, so a rerun resumes what is done."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import transformers

from ..backends import presets
from ..backends.runner import resolve_device
from ..errors import UserError
from ..runs import append_jsonl, lock_dir, project_path, read_json, read_jsonl, settings_problem, write_json
from ..setup.pair import DEFAULT_PAIR
from .sweep_grid import ROW_KEYS, Baseline, Configuration

if TYPE_CHECKING:
    from .sweep_config import SweepConfig

RESULTS = "results.jsonl"
# config keys that change the numbers in results.jsonl; a resume must keep them (with the pair's, _settings)
RESULT_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "chat", "seed", "k_max", "max_prompt_tokens")
# the pair's settings in settings.json, which keeps them flat and spells unset ones as it always has
PAIR_RESULT_KEYS = ("backend", "n_ctx", "draft", "target", "dtype", "draft_quant", "draft_vocab", "threads")
UNSET = {"n_ctx": 0, "draft_vocab": "", "threads": 0}
# torch settings a sweep may set: recorded only when set, so an existing sweep's settings hash holds
PAIR_IF_SET = ("kv_cache", "runtime", "max_cache_len", "target_quant", "draft_context")


def open_out_dir(cfg: SweepConfig) -> tuple[Path, dict, object]:
    """The sweep's out_dir (default runs/sweep/<name>, relative to the project root), made and locked for this
    process (the lock, held until it exits, is returned), and the settings its results depend on; results of
    other settings found there are refused, or with overwrite discarded (check_out_dir)."""
    settings = settings_of(cfg)
    out = project_path(cfg.out_dir or f"runs/sweep/{cfg.name or 'sweep'}")
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, "sweep")
    check_out_dir(out, settings, cfg.overwrite)
    return out, settings, lock


def settings_of(cfg: SweepConfig, device: str | None = None) -> dict:
    """settings.json's settings; `device`: the one the pair runs on (default: resolved from pair.device)."""
    p = cfg.pair
    d = {k: UNSET[k] if k in UNSET and getattr(p, k) is None else getattr(p, k) for k in PAIR_RESULT_KEYS}
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
    for pin in out.glob("costs@*.json"):  # the other drafts entries' pinned costs (Runner.pin_costs)
        pin.unlink()


def prompt_sha(text) -> str:
    """A prompt's id: its text's hash (a conversation's: its messages' JSON)."""
    text = text if isinstance(text, str) else json.dumps(text, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Job(NamedTuple):
    dataset: str
    prompt_idx: int  # in the shuffled set
    text: str
    ids: list[int]
    conf: Configuration


def check_calibration(out: Path, cal_settings: dict) -> None:
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


def cpu_pad_to(pair) -> dict:
    # the CPU padding is measured at each load, so a resumed sweep may run with another one:
    # config.json has this run's, and every row carries the one it ran with
    return {role: list(getattr(m.model, "cpu_pad_to", ())) for role, m in
            (("target", pair.target), ("draft", pair.draft)) if m is not None}


def row_context(settings: dict, pair, runtime: dict) -> dict:
    """drafts entry -> what every row of its pair carries: the machine and the numeric paths it ran on ("auto"
    resolves per CPU); `pair`: the first, whose CPU padding every pair shares; `runtime`: entry -> runtime_info."""
    pad_to = cpu_pad_to(pair)
    return {d: {"settings_hash": settings_hash(settings), "cpu_pad_to": pad_to, "isa": r["machine"]["isa"],
                "cpu_flags": r["machine"]["cpu_flags"], "paths": {m: r.get(f"{m}_path") for m in ("target", "draft")}}
            for d, r in runtime.items()}


def config_record(config: dict, cfg: SweepConfig, grid: list, notes: list[str], runtime: dict, pair) -> dict:
    """config.json's content: the full config (`config`, config_to_dict's), the grid and notes, and what ran it;
    `runtime`: drafts entry -> its pair's runtime_info; `pair`: the first, whose models a trace names."""
    trace = {"trace_pair": trace_pair(cfg, pair)} if cfg.record_trace else {}
    return {
        "config": config, "grid": [c.key for c in grid], "notes": notes,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "cpu_pad_to": cpu_pad_to(pair),
        "runtime": next(iter(runtime.values())),
        **({"drafts_runtime": runtime} if cfg.drafts else {}),
        **trace}


def start_run(out: Path, settings: dict, heads: dict, selected: dict, config: dict,
              grid: list[Configuration]) -> tuple[list[Job], int]:
    """Write settings.json, heads.json (`heads`: those of the config's `heads`), prompts.json and config.json
    (config_record's, with the device and when: see the module doc); return the runs not yet in results.jsonl
    and the number of runs in all. Prompt-major and round-robin over datasets: a sweep stopped early (or still
    running) has every config on the same prompts and every dataset about equally far along, so its partial
    results already compare side by side."""
    jobs = [Job(ds, *chosen[rank], c) for rank in range(max(len(v) for v in selected.values()))
            for ds, chosen in selected.items() if rank < len(chosen) for c in grid]
    keys = [(j.dataset, j.prompt_idx, prompt_sha(j.text), j.conf.key) for j in jobs]
    prompts = {ds: [{"prompt_idx": i, "prompt_sha": prompt_sha(t), "n_prompt_tokens": len(ids), "text": t}
                    for i, t, ids in chosen] for ds, chosen in selected.items()}
    first = {k: config.pop(k) for k in ("config", "grid", "notes")}  # config.json's keys in their order
    record = {**first, "device": settings["device"], **config, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(out / "settings.json", {"settings": settings, "hash": settings_hash(settings)})
    write_json(out / "heads.json", {k: v[1] for k, v in heads.items()}, default=str)
    write_json(out / "prompts.json", prompts, indent=1)
    write_json(out / "config.json", record, default=str)
    done = {(r.get("dataset"), r.get("prompt_idx"), r.get("prompt_sha"), r.get("config"))
            for r in read_jsonl(out / RESULTS, repair=True)}
    return [j for j, key in zip(jobs, keys) if key not in done], len(jobs)


def row_fields(conf: Configuration) -> dict:
    """A configuration's fields in its rows: its key, ROW_KEYS, its `drafts` entry, then its own (Configuration.row)."""
    base = {"config": conf.key, **{k: conf.row.get(k) for k in ROW_KEYS}}
    if conf.draft is not None:  # a `drafts` entry: the draft configuration it ran with
        base["draft"] = conf.draft
    return {**base, **conf.row}


def append_row(out: Path, job: Job, seed: int, result: tuple, context: dict) -> None:
    """One run's row, appended to results.jsonl (fsynced) as soon as it is done: the job, the configuration's
    fields, the result (Metrics, stopped_by, new ids, extra fields) and `context`, what every row of its pair
    carries (row_context's)."""
    m, stopped, new, extra = result
    peer = job.conf.policy in (Baseline.HF_ASSISTED, Baseline.HF_PROMPT_LOOKUP)
    row = {"dataset": job.dataset, "prompt_idx": job.prompt_idx, "prompt_sha": prompt_sha(job.text),
           "n_prompt_tokens": len(job.ids), **row_fields(job.conf), "seed": seed, "stopped_by": stopped,
           "output_sha": prompt_sha(json.dumps(new)), **m.to_dict(), **extra, "counts_derived": peer, **context,
           "time": time.time()}
    append_jsonl(out / RESULTS, row)


def trace_pair(cfg: SweepConfig, pair) -> dict:
    """Which models recorded the traces: per role the name the config gave, its hub id (the default pair's
    from setup/pair.py; a hub id as given; None for a folder), the weights' fingerprint and the vocabulary, and the
    GPU preset (backends/presets.py) of those hub ids, so a replay on another pair's shapes is labelled as
    borrowed acceptance."""
    out = {}
    for role in ("draft", "target"):
        lm, name = getattr(pair, role), getattr(cfg.pair, role)
        if lm is None:
            continue
        hub = (DEFAULT_PAIR[role].hub_id if name in (None, "", "default")
               else None if Path(str(name)).expanduser().exists() else str(name))
        out[role] = {"name": name, "hub_id": hub, "vocab_size": lm.vocab_size,
                     "fingerprint": lm.fingerprint() if hasattr(lm, "fingerprint") else None,
                     "draft_quant": cfg.pair.draft_quant if role == "draft" else None}
    match = presets.by_hub_ids(*(out.get(r, {}).get("hub_id") for r in ("draft", "target")))
    out["preset"] = match.name if match else None
    return out
