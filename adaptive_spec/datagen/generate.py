"""Training data for acceptance-prediction heads (SpecDec++ section 4.4, appendix D.1).

For every prompt x we sample a target response X_1..X_N, and at every position i
  q_i = q(.|x, X<i) (draft), p_i = p(.|x, X<i) (target), Y_i ~ q_i,
  P_i = min(1, p_i(Y_i) / q_i(Y_i))          -- the head's training target,
  1 - TV(p_i, q_i) = sum_v min(p_i, q_i)      -- the expected acceptance, stored for analysis.
Token mixing: Z_i = X_i with probability r, else Y_i; the loss is taken where Z_i came from Y
(`loss_mask`). The draft's final hidden state at the position whose input token is Z_i is stored
(`features`, one more draft pass over Z) so training never runs the draft, and so are
features.draft_stats(q_i, Y_i). p_i and q_i come from the generation pass itself (target and draft
stepped in lockstep on the sampled X: batched.py), so no teacher-forced re-run is needed.

docs/datagen.md has the prompts, sources, resuming and running; shards.py the output format. A shard
is the unit of work: written atomically, its random numbers seeded by (seed, split, shard index) only,
so a rerun after a kill skips finished shards and produces byte-identical files. Under `accelerate
launch` shard k goes to process k % world_size."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backends.models import check_vocab, load_model, resolve_dtype
from ..backends.paths import resolve_model_path
from ..backends.cpu.quant import densify_quantized
from ..backends.runner import model_fingerprint, resolve_device
from ..config import config_from_argv
from ..errors import UserError, get_logger, run_main
from ..prompts import encode_prompt, eos_token_ids, prompt_texts
from ..runs import settings_problem
from .batched import _input_device, generate_shard
from .config import DRAFT_KEYS, UNHASHED_KEYS, WORK_ORDER, DatagenConfig, config_hash
from .shards import FORMAT, SPLITS, existing_manifest, folder_manifest, save_shard, shard_file, write_manifest

log = get_logger(__name__)


def load_prompt_texts(cfg: DatagenConfig, source: dict | None = None) -> list[str]:
    """All prompt texts of one source (default: the first, or `dataset`), in file order (the same
    named sets, files and hub datasets as sweeps: adaptive_spec.prompts)."""
    src = source or cfg.source_list()[0]
    hub = (None, None) if cfg.sources else (cfg.dataset_config, cfg.dataset_split)  # a mix names no hub sets
    return prompt_texts(src["name"], src["field"] or None, *hub)


def _unit(text: str) -> float:
    """A uniform number in [0, 1) from a hash of `text`: the same on every machine and run."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_of(text: str, train_frac: float, dev_frac: float) -> str:
    """train/dev/test by a hash of the prompt text: stable, and duplicates land together."""
    u = _unit(text)
    return "train" if u < train_frac else "dev" if u < train_frac + dev_frac else "test"


def plan_splits(cfg: DatagenConfig, tok) -> dict[str, list[tuple[int, list[int]]]]:
    """(source index, token ids) of the prompts of each split: deduplicated (across sources too: a
    text drawn by an earlier source is skipped by later ones), length-filtered, capped per source,
    at most n per source.

    `dataset` keeps file order. A mix takes each set in an order of its own hash, so n draws a
    random subset independent of the split, and then interleaves the sources the same way in every
    split, so a partial run (or one shard) already holds the mix."""
    caps = {s: getattr(cfg, f"max_{s}_prompts") for s in SPLITS}
    plan: dict[str, list] = {s: [] for s in SPLITS}
    taken: set[str] = set()
    for i, src in enumerate(cfg.source_list()):
        texts = [t for t in dict.fromkeys(load_prompt_texts(cfg, src)) if t not in taken]
        if cfg.sources:
            texts.sort(key=lambda t: _unit(f"draw/{t}"))
        by_split: dict[str, list] = {s: [] for s in SPLITS}
        n = 0
        for t in texts:
            if n == src["n"]:
                break
            s = split_of(t, cfg.train_frac, cfg.dev_frac)
            if 0 <= caps[s] <= len(by_split[s]):
                continue
            e = encode_prompt(tok, t, cfg.chat_template, template_optional=True)
            if len(e) <= cfg.max_prompt_tokens:
                by_split[s].append((t, i, e))
                taken.add(t)
                n += 1
        if 0 < src["n"] != n:
            log.warning(f"datagen: source {src['name']} gave {n} prompts, not n = {src['n']} (it has no more that fit "
                        "max_prompt_tokens and the caps)")
        for s in SPLITS:
            plan[s] += by_split[s]
    if cfg.sources:
        for s in SPLITS:
            plan[s].sort(key=lambda r: _unit(f"order/{r[0]}"))
    return {s: [(i, e) for _, i, e in plan[s]] for s in SPLITS}


def load_models(cfg: DatagenConfig, device):
    """(draft, target, tokenizer, shared vocabulary size) as datagen runs them."""
    # every datagen pass is batched (prefill, a batch of rows per step, the features pass): no
    # fp16 copies for short inputs (pack_cpu_linears), whose memory a batch would rather have
    p = cfg.pair
    draft, dtok = load_model(p.draft, "draft", p.dtype, device, quant=p.draft_quant, draft_vocab=p.draft_vocab,
                             fp16=False)
    # the int8 kernel's per-row cost loses to a dense GEMM over the same int8-valued weights
    densify_quantized(draft)
    if cfg.target_device_map:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: for a target spread over GPUs only

        path = resolve_model_path(p.target, "target")
        ttok = AutoTokenizer.from_pretrained(path)
        target = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(p.dtype),
                                                      device_map=cfg.target_device_map).eval()
    else:
        target, ttok = load_model(p.target, "target", p.dtype, device, fp16=False)
    vocab = check_vocab(dtok, ttok, draft, target)
    return draft, target, ttok, vocab


def shard_generator(seed: int, split: str, shard: int, device) -> torch.Generator:
    """Random numbers of a shard depend on (seed, split, shard index) only: resumable."""
    s = int.from_bytes(hashlib.sha256(f"{seed}/{split}/{shard}".encode()).digest()[:8], "big") >> 1
    return torch.Generator(device=device).manual_seed(s)


def build_manifest(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict) -> dict:
    """The manifest of a run of `cfg` as the folder stands (shards.folder_manifest)."""
    return folder_manifest(out_dir, config=cfg.stored(), config_hash=config_hash(cfg), seed=cfg.seed,
                           sources=cfg.source_list(), models=models, planned=planned)


def _identity(config: dict, models: dict, planned: dict) -> dict:
    """What a run's shards depend on: the hashed config keys, the weights, the prompts of each split."""
    d = {k: v for k, v in config.items() if k not in UNHASHED_KEYS}
    d.update({f"{r} weights": (models.get(r) or {}).get("fingerprint") for r in ("draft", "target")})
    d.update({f"{s} prompts": (planned.get(s) or {}).get("prompts_hash") for s in SPLITS})
    return d


def _existing_run(out_dir: Path) -> dict | None:
    """The manifest of the datagen run in out_dir, None for an empty or missing folder; a folder
    holding anything else is refused."""
    refusal = f"out_dir {out_dir} is not empty and holds no datagen run; choose another out_dir"
    man = existing_manifest(out_dir, refusal, "out_dir")
    if man is not None and man.get("format") != FORMAT:
        raise UserError(refusal)
    return man


def check_draft_config(out_dir: Path, cfg: DatagenConfig):
    """Refuse to resume a run made for another draft configuration, before any model loads.

    Heads are trained for the draft they serve (its q, its hidden states): shards of two draft
    configurations in one dataset would silently mix two training sets."""
    man = None if cfg.overwrite else _existing_run(out_dir)
    old, new = (man or {}).get("config") or {}, cfg.stored()
    diff = [f"{k}: {old.get(k)!r} there, {new[k]!r} now" for k in DRAFT_KEYS if man and old.get(k) != new[k]]
    if diff:
        raise UserError(f"out_dir {out_dir} holds a datagen run made with another draft configuration "
                        f"({'; '.join(diff)}); one dataset serves one draft configuration: choose another out_dir "
                        "for this one, or pass overwrite=true to replace that run")


class _State:
    """Process topology: accelerate's PartialState under `accelerate launch`, else one process
    (importing accelerate is skipped then, which keeps tests and single runs quick)."""

    def __init__(self):
        self._acc = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState  # optional: the [train] extra, under accelerate launch only

            self._acc = PartialState()
        self.index = self._acc.process_index if self._acc else 0
        self.world = self._acc.num_processes if self._acc else 1
        self.is_main = self.index == 0

    def device(self, requested: str):
        if self._acc is not None and requested in ("", "auto"):
            return self._acc.device
        return resolve_device(requested)

    def barrier(self):
        if self._acc is not None:
            self._acc.wait_for_everyone()


def run(cfg: DatagenConfig) -> dict:
    """Generate (or resume) the dataset; returns the final manifest."""
    threads = torch.get_num_threads()
    if cfg.pair.threads:
        torch.set_num_threads(cfg.pair.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)  # callers (tests, notebooks) keep their own setting


def _run(cfg: DatagenConfig) -> dict:
    state = _State()
    device = state.device(cfg.pair.device or "auto")
    out_dir = cfg.resolved_out_dir()
    check_draft_config(out_dir, cfg)  # before the minutes that loading the models takes
    draft, target, tok, vocab = load_models(cfg, device)
    models = {role: {"name": getattr(cfg.pair, role), "hidden_size": m.config.hidden_size, "vocab_size": vocab,
                     "fingerprint": model_fingerprint(m)} for role, m in (("draft", draft), ("target", target))}
    plan = plan_splits(cfg, tok)
    n_src = len(cfg.source_list())
    planned = {s: {"n_prompts": len(plan[s]), "n_shards": -(-len(plan[s]) // cfg.shard_size),
                   "prompts_hash": hashlib.sha256(json.dumps(plan[s]).encode()).hexdigest()[:16],
                   "by_source": [sum(1 for i, _ in plan[s] if i == k) for k in range(n_src)]} for s in SPLITS}
    _prepare_out_dir(out_dir, cfg, models, planned, state)

    eos_ids, pad_id = eos_and_pad(tok, target)
    gen_device = device if not cfg.target_device_map else _input_device(draft)
    # this process's shards still missing on disk, the small evaluation splits first (WORK_ORDER)
    todo = [(s, k) for s in WORK_ORDER for k in range(planned[s]["n_shards"])
            if k % state.world == state.index and not (out_dir / shard_file(s, k)).is_file()]
    progress = _Progress(cfg, state, out_dir, plan, planned, todo)
    for s, k in todo:
        chunk = plan[s][k * cfg.shard_size:(k + 1) * cfg.shard_size]
        gen = shard_generator(cfg.seed, s, k, gen_device)
        seqs = generate_shard(draft, target, [e for _, e in chunk], cfg, vocab, eos_ids, pad_id, gen,
                               progress.batch_done)
        for seq, (i, _) in zip(seqs, chunk):
            seq["source"] = i
        meta = save_shard(out_dir, s, k, seqs, cfg.store_features, config_hash(cfg), n_src)
        if state.is_main:
            write_manifest(out_dir, build_manifest(out_dir, cfg, models, planned))
        progress.shard_done(shard_file(s, k), meta)
    progress.bar.close()
    state.barrier()
    man = build_manifest(out_dir, cfg, models, planned)
    if state.is_main:
        write_manifest(out_dir, man)
        log.info(f"datagen: done: {out_dir} complete={man['complete']}; " + ", ".join(
            f"{s} {man['splits'][s]['n_prompts']} prompts / {man['splits'][s]['n_tokens']} tokens" for s in SPLITS))
    return man


def _prepare_out_dir(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict, state: "_State"):
    """Refuse a folder of another run, wipe it with overwrite=true, write the manifest, drop the
    half-written shards of a killed run."""
    man = _existing_run(out_dir)  # every process checks; only main mutates
    if man is not None and not cfg.overwrite:
        old = _identity(man.get("config", {}), man.get("models", {}), man.get("planned", {}))
        problem = settings_problem(out_dir, old, _identity(cfg.stored(), models, planned), "datagen run")
        if problem:
            raise UserError(f"{problem}; pass the same config to resume it, choose another out_dir, or pass "
                            "overwrite=true to start over")
    state.barrier()  # nobody may still be reading out_dir while the main process wipes it
    if state.is_main:
        if man is not None and cfg.overwrite:
            shutil.rmtree(out_dir)
        # the manifest first: a folder with anything else in it is then always recognisable
        out_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(out_dir, build_manifest(out_dir, cfg, models, planned))
        for s in SPLITS:
            (out_dir / s).mkdir(exist_ok=True)
            for stale in (out_dir / s).glob(".*.tmp.*"):
                stale.unlink()
    state.barrier()


def eos_and_pad(tok, target) -> tuple[list[int], int]:
    """The ids that end a response, and the id that left-pads a batch."""
    eos_ids = eos_token_ids(tok, target)
    return eos_ids, tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)


class _Progress:
    """tqdm over prompts, and a plain line per shard when stderr is a log file (nohup), where
    tqdm's carriage-return updates do not show."""

    def __init__(self, cfg, state, out_dir, plan, planned, todo):
        self.n_todo = sum(len(plan[s][k * cfg.shard_size:(k + 1) * cfg.shard_size]) for s, k in todo)
        done_before = sum(planned[s]["n_prompts"] for s in SPLITS) - self.n_todo if state.world == 1 else 0
        if state.is_main:
            log.info(f"datagen: {out_dir}: " + ", ".join(f"{s} {planned[s]['n_prompts']} prompts" for s in SPLITS)
                     + f"; {len(todo)} shard(s) to do on this process"
                     + (f", {done_before} prompts already done" if done_before else ""))
            if cfg.sources:
                log.info("datagen: prompts per source (train/dev/test): " + ", ".join(
                    f"{src['name']} " + "/".join(str(planned[s]["by_source"][i]) for s in SPLITS)
                    for i, src in enumerate(cfg.sources)))
        self.bar = tqdm(total=self.n_todo, unit="prompt", disable=not cfg.progress, dynamic_ncols=True,
                        mininterval=1.0, desc=f"datagen[{state.index}]" if state.world > 1 else "datagen")
        self.t0, self.n_tok, self.n_prompts = time.perf_counter(), 0, 0

    def batch_done(self, batch: list[dict]):
        self.n_tok += sum(len(q["z"]) for q in batch)
        self.n_prompts += len(batch)
        self.bar.update(len(batch))
        self.bar.set_postfix_str(f"{self.n_tok / (time.perf_counter() - self.t0):.1f} tok/s, {self.n_tok} tok")

    def shard_done(self, name: str, meta: dict):
        if self.bar.disable or sys.stderr.isatty():
            return
        el = time.perf_counter() - self.t0
        eta = el / self.n_prompts * (self.n_todo - self.n_prompts)
        log.info(f"\ndatagen: wrote {name} ({meta['n_seqs']} seqs, {meta['n_tokens']} tokens); "
                 f"{self.n_tok} tokens in {el:.0f}s = {self.n_tok / el:.2f} tok/s; {self.n_prompts}/{self.n_todo} "
                 f"prompts, ETA {eta / 3600:.1f} h")


INTERRUPTED = "finished shards are kept; rerun the same command to resume"


def _main(argv) -> int:
    cfg = config_from_argv(DatagenConfig, argv, "adaptive-spec datagen", __doc__.split("\n\n")[0], "datagen")
    run(cfg)
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
