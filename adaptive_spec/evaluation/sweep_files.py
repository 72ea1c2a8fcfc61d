"""A sweep's out_dir (SweepFolder): the files it writes (the module doc of sweep.py lists them; costs.json and
tree_calibration.json: sweep_calibration.py), the check that keeps one out_dir to one set of settings, so a rerun
resumes what is done, and the rows it grows. Part of `adaptive-spec sweep`."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import transformers

from ..backends import presets
from ..backends.paths import FeatureDraft
from ..errors import UserError
from ..runs import append_jsonl, lock_dir, project_path, read_json, read_jsonl, settings_problem, write_json
from ..setup.pair import DEFAULT_PAIR
from .sweep_grid import PEERS, ROW_KEYS, Configuration

if TYPE_CHECKING:
    from ..params import PairParams

RESULTS = "results.jsonl"


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


TREE_CALIBRATION = "tree_calibration.json"
COSTS = "costs.json"
RUN_FILES = (RESULTS, "settings.json", "config.json", "heads.json", "prompts.json", TREE_CALIBRATION, COSTS)


def claim_out_dir(out_dir: str | Path, settings: dict, overwrite: bool):
    """Find the out_dir (a relative one from the project root), make it and lock it for this process; return it and
    the lock, held until the process exits or the lock is closed. Refuse to mix results of different settings in it,
    or with `overwrite` discard results of other (or unknown) settings instead. Results of the same settings are
    always resumed."""
    out = project_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, "sweep")  # before anything is read: another sweep may be writing there
    saved = read_json(out / "settings.json", required=False, hint="delete it, or use another out_dir")
    rfile = out / RESULTS
    if saved is not None:
        problem = settings_problem(out, saved.get("settings", {}), settings, "sweep")
    elif rfile.is_file() and rfile.stat().st_size:
        problem = f"{out} holds a {RESULTS} without settings.json, so its settings are unknown"
    else:
        problem = None
    if problem is None:
        return out, lock
    if not overwrite:
        if lock is not None:  # released now, not when the error's traceback is dropped
            lock.close()
        raise UserError(f"{problem}; use another out_dir, or overwrite=true to discard them")
    print(f"note: {problem}; overwrite=true: discarding them", file=sys.stderr)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for pin in out.glob("costs@*.json"):  # the other drafts entries' pinned costs (sweep_calibration)
        pin.unlink()
    return out, lock


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


@dataclass(frozen=True)
class FolderPlan:
    """The out_dir and what it records besides the rows (SweepFolder), as the plan (sweep.py) gives them."""

    out_dir: str  # as the config writes it: relative to the project root
    settings: dict  # settings.json's: what the results depend on (sweep.settings_of)
    overwrite: bool  # discard results of other settings found there
    config: dict  # config.json's "config": the config as given
    heads: dict  # heads.json's: label -> info, of the config's `heads`
    trace: PairParams | None  # the pair whose models a trace names (trace_pair); None without record_trace
    drafts: bool  # a drafts axis: config.json keeps every entry's runtime


class SweepFolder:
    """The sweep's out_dir, opened (made, locked for this process, its settings checked: open), then recorded
    (settings.json, heads.json, prompts.json, config.json: start) and grown one row per run (append_row)."""

    def __init__(self, plan: FolderPlan, path: Path, lock):
        self.plan, self.path, self.lock = plan, path, lock  # the lock is held until this process exits
        self.hash = settings_hash(plan.settings)
        self.context = {}  # drafts entry -> what every row of its pair carries (set by start)

    @classmethod
    def open(cls, plan: FolderPlan) -> SweepFolder:
        """The out_dir claimed for this process (claim_out_dir)."""
        return cls(plan, *claim_out_dir(plan.out_dir, plan.settings, plan.overwrite))

    def start(self, grid: list[Configuration], selected: dict, notes: list[str], pairs: dict) -> tuple[list[Job], int]:
        """Write settings.json, heads.json, prompts.json (`selected`: dataset -> [(i, text, ids)]) and config.json
        (the config, the grid, `notes` and what runs it: `pairs`, drafts entry -> pair, the first's models
        a trace names); return the runs not yet in results.jsonl and the number of runs in all. Prompt-major and
        round-robin over datasets: a sweep stopped early (or still running) has every config on the same
        prompts and every dataset about equally far along, so its partial results already compare side by side."""
        jobs = [Job(ds, *chosen[rank], c) for rank in range(max(len(v) for v in selected.values()))
                for ds, chosen in selected.items() if rank < len(chosen) for c in grid]
        keys = [(j.dataset, j.prompt_idx, prompt_sha(j.text), j.conf.key) for j in jobs]
        prompts = {ds: [{"prompt_idx": i, "prompt_sha": prompt_sha(t), "n_prompt_tokens": len(ids), "text": t}
                        for i, t, ids in chosen] for ds, chosen in selected.items()}
        runtime = {d: p.runtime_info() for d, p in pairs.items()}
        pair = next(iter(pairs.values()))  # the first: every pair shares its CPU padding
        self.context = self._context(cpu_pad_to(pair), runtime)
        record = self._record(grid, notes, runtime, pair)
        write_json(self.path / "settings.json", {"settings": self.plan.settings, "hash": self.hash})
        write_json(self.path / "heads.json", self.plan.heads, default=str)
        write_json(self.path / "prompts.json", prompts, indent=1)
        write_json(self.path / "config.json", record, default=str)
        done = {(r.get("dataset"), r.get("prompt_idx"), r.get("prompt_sha"), r.get("config"))
                for r in read_jsonl(self.path / RESULTS, repair=True)}
        return [j for j, key in zip(jobs, keys) if key not in done], len(jobs)

    def _context(self, pad_to: dict, runtime: dict) -> dict:
        """drafts entry -> what every row of its pair carries: the settings' hash, the CPU padding, the machine and
        the numeric paths it ran on ("auto" resolves per CPU)."""
        return {d: {"settings_hash": self.hash, "cpu_pad_to": pad_to, "isa": r["machine"]["isa"],
                    "cpu_flags": r["machine"]["cpu_flags"],
                    "paths": {m: r.get(f"{m}_path") for m in ("target", "draft")}} for d, r in runtime.items()}

    def _record(self, grid: list, notes: list[str], runtime: dict, pair) -> dict:
        """config.json's content: the full config, the grid and notes, and what ran it, with the device and when."""
        plan = self.plan
        return {
            "config": plan.config, "grid": [c.key for c in grid], "notes": notes, "device": plan.settings["device"],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_pad_to": cpu_pad_to(pair),
            "runtime": next(iter(runtime.values())),
            **({"drafts_runtime": runtime} if plan.drafts else {}),
            **({"trace_pair": trace_pair(plan.trace, pair)} if plan.trace is not None else {}),
            "written": time.strftime("%Y-%m-%d %H:%M:%S")}

    def append_row(self, job: Job, seed: int, result: tuple) -> None:
        """One run's row, appended to results.jsonl (fsynced) as soon as it is done: the job, the configuration's
        fields, the result (Metrics, stopped_by, new ids, extra fields) and what every row of its pair carries."""
        m, stopped, new, extra = result
        peer = job.conf.policy in PEERS
        context = self.context[next(iter(self.context)) if job.conf.draft is None else job.conf.draft]
        row = {"dataset": job.dataset, "prompt_idx": job.prompt_idx, "prompt_sha": prompt_sha(job.text),
               "n_prompt_tokens": len(job.ids), **row_fields(job.conf), "seed": seed, "stopped_by": stopped,
               "output_sha": prompt_sha(json.dumps(new)), **m.to_dict(), **extra, "counts_derived": peer, **context,
               "time": time.time()}
        append_jsonl(self.path / RESULTS, row)


def cpu_pad_to(pair) -> dict:
    # the CPU padding is measured at each load, so a resumed sweep may run with another one:
    # config.json has this run's, and every row carries the one it ran with (a feature drafter: no model, none)
    return {role: list(getattr(getattr(m, "model", None), "cpu_pad_to", ())) for role, m in
            (("target", pair.target), ("draft", pair.draft)) if m is not None}


def row_fields(conf: Configuration) -> dict:
    """A configuration's fields in its rows: its key, ROW_KEYS, its `drafts` entry, then its own (Configuration.row)."""
    base = {"config": conf.key, **{k: conf.row.get(k) for k in ROW_KEYS}}
    if conf.draft is not None:  # a `drafts` entry: the draft configuration it ran with
        base["draft"] = conf.draft
    return {**base, **conf.row}


def trace_pair(params: PairParams, pair) -> dict:
    """Which models recorded the traces: per role the name the config gave, its hub id (the default pair's
    from setup/pair.py; a hub id as given; None for a folder or a feature drafter, whose entry says `drafter:
    feature`), the weights' fingerprint and the vocabulary, and the GPU preset (backends/presets.py) of those hub
    ids, so a replay on another pair's shapes is labelled as borrowed acceptance."""
    out = {}
    for role in ("draft", "target"):
        lm, name = getattr(pair, role), getattr(params, role)
        if lm is None:
            continue
        feature = isinstance(name, FeatureDraft)
        hub = (DEFAULT_PAIR[role].hub_id if name in (None, "", "default")
               else None if feature or Path(str(name)).expanduser().exists() else str(name))
        out[role] = {"name": str(name) if feature else name, "hub_id": hub, "vocab_size": lm.vocab_size,
                     "fingerprint": lm.fingerprint() if hasattr(lm, "fingerprint") else None,
                     "draft_quant": params.draft_quant if role == "draft" else None,
                     **({"drafter": "feature"} if feature else {})}
    match = presets.by_hub_ids(*(out.get(r, {}).get("hub_id") for r in ("draft", "target")))
    out["preset"] = match.name if match else None
    return out
