"""Training data for acceptance-prediction heads (SpecDec++ section 4.4, appendix D.1).

For every prompt x we sample a target response X_1..X_N, and at every position i
  q_i = q(.|x, X<i) (draft), p_i = p(.|x, X<i) (target), Y_i ~ q_i,
  P_i = min(1, p_i(Y_i) / q_i(Y_i))          -- the head's training target,
  1 - TV(p_i, q_i) = sum_v min(p_i, q_i)      -- the expected acceptance, stored for analysis.
Token mixing: Z_i = X_i with probability r, else Y_i; the loss is taken where Z_i came from Y
(`loss_mask`). The head sees the draft's final hidden state at the position whose input token is
Z_i, i.e. e_i(x, Z<i, Z_i); we store it (`features`) so training never runs the draft. The
draft's own statistics of its candidate, features.draft_stats(q_i, Y_i) (log q_i(Y_i), entropy
of q_i, top-1 minus top-2 probability), are stored too (`draft_stats`).

Prompts come from one set (`dataset`) or a mix of named training sets (`sources`, each drawn and
split train/dev/test on its own, so every source has its own dev prompts); `source_ids` says which
source each sequence came from, and the manifest counts prompts and tokens per source and split.

p_i and q_i come from the generation pass itself: target and draft are stepped in lockstep on
the sampled X (batched, left padded, KV cached), so no teacher-forced re-run of the target is
needed. Only the features need a second draft pass, over Z alone (the prompt's KV cache is reused).
Where the time goes (CPU): prompts are prefilled one by one (no pad rows: a prefill is
compute-bound), a row leaves the batch and both caches when it samples EOS, and an int8 draft
computes with a dense copy of its dequantized weights (every pass here is batched).

On-disk format (a contract with the trainer; see docs/datagen.md):
  out_dir/manifest.json  {"format": "adaptive_spec.datagen.v1", "config", "config_hash", "seed",
                          "models": {"draft"|"target": {name, hidden_size, vocab_size, fingerprint}},
                          "splits": {split: {n_prompts, n_tokens, n_loss_tokens, shards: [...]}},
                          "sources": [{name, n, field, splits: {split: {n_prompts, n_tokens, n_loss_tokens}}}],
                          "complete"}
  out_dir/<split>/shard-NNNNN.safetensors with input_ids, input_offsets, prompt_lens, source_ids
  (per sequence: an index into manifest "sources"), resp_offsets, x_ids, y_ids, z_ids, loss_mask,
  accept_prob, expected_accept, draft_stats [T, 3] float32 [, features].
n_tokens counts response tokens (T), n_loss_tokens those with loss_mask 1.

Resuming: a shard is the unit of work. It is written atomically, and its random numbers come
from a generator seeded by (seed, split, shard index) only, so rerunning the same command after
a kill skips finished shards and produces byte-identical files.

Run: `adaptive-spec datagen --config configs/datagen/gsm8k.yaml [key=value ...]`, or
`python -m adaptive_spec.datagen.generate ...`, or many processes with `accelerate launch -m
adaptive_spec.datagen.generate ...` (shard k goes to process k % world_size).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..backends.models import (check_vocab, densify_quantized, load_model, model_fingerprint, model_kv, resolve_device,
                               resolve_dtype, resolve_model_path, spread_kept_logits)
from ..config import config_from_argv, config_to_dict
from ..decoding.sampling import SamplingParams, process_logits, sample
from ..errors import UserError, get_logger, run_main
from ..heads.features import draft_stats
from ..params import PairParams
from ..prompts import EVAL_SETS, TRAINING_SETS, encode_prompt, eos_token_ids, prompt_texts
from ..runs import atomic_write, project_path, read_manifest, settings_problem, write_json

log = get_logger(__name__)

FORMAT = "adaptive_spec.datagen.v1"
SPLITS = ("train", "dev", "test")
WORK_ORDER = ("dev", "test", "train")  # the small evaluation splits first: a partial run is already usable
# Keys that cannot change what is generated: a resume may change them freely.
UNHASHED_KEYS = ("name", "out_dir", "overwrite", "threads", "progress")
# What a head is trained for: a run of one draft configuration is never resumed with another.
DRAFT_KEYS = ("draft", "draft_quant", "draft_vocab")
# The pair's settings as the manifest's config (format v1) stores them: flat, and unset ones spelled as
# they always were, so that a run's config hash, which names its shards and cached features, holds.
STORED_PAIR = ("draft", "target", "dtype", "draft_quant", "draft_vocab", "device", "threads")
STORED_UNSET = {"draft_vocab": "", "device": "auto", "threads": 0}
# settings of the pair that datagen does not read (it runs the torch engine with dynamic caches)
UNREAD_PAIR = ("backend", "n_ctx", "kv_cache", "runtime", "max_cache_len")
SOURCE_KEYS = ("name", "n", "field")
_META_KEY = "adaptive_spec.datagen"  # the single safetensors metadata key (see _write_shard)


@dataclass
class DatagenConfig:
    name: str = ""  # names the default out_dir runs/datagen/<name>; defaults to the config file's stem
    # prompts: a named set of adaptive_spec.prompts (gsm8k-train, alpaca, humaneval, sharegpt, ...),
    # a local .json/.jsonl file, or a hub dataset
    dataset: str = ""
    # ... or a mix of named training sets, each drawn and split on its own (dev prompts per source):
    # [{name: sharegpt, n: 2400}, {name: mbpp}]; n = prompts taken from the set (-1 or absent: all),
    # field = its text field (absent: the set's own). Set `dataset` or `sources`, not both.
    sources: list[dict | str] = field(default_factory=list)
    dataset_config: str | None = None  # hub dataset configuration, e.g. "main" for gsm8k
    dataset_split: str = "train"  # the hub dataset's own split that prompts are read from
    prompt_field: str = ""  # "" = the named set's own field, else the first of prompt/instruction/question/text
    # our train/dev/test split, by a hash of the prompt text (stable across runs and machines)
    train_frac: float = 0.8
    dev_frac: float = 0.1
    test_frac: float = 0.1
    # caps per split (per source in a mix), taking the split's prompts in order: -1 = all, 0 = skip the split
    max_train_prompts: int = -1
    max_dev_prompts: int = -1
    max_test_prompts: int = -1
    max_prompt_tokens: int = 1024  # longer prompts are dropped (before the caps)
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    # the models, as `generate` takes them (params.PairParams): pair: {draft_quant: int8, dtype: auto, threads: 2};
    # heads should be trained on the draft configuration they serve
    pair: PairParams = field(default_factory=PairParams)
    target_device_map: str = ""  # e.g. "auto": spread the target over the visible GPUs
    # sampling: p and q are both processed with these (as in decoding)
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_at_eos: bool = True  # a response ends with (and includes) the first EOS
    batch_size: int = 8
    shard_size: int = 64  # prompts per shard file: the unit of resume
    mix_ratio: float = 0.15  # r: share of response positions that keep the target token X_i
    seed: int = 0
    store_features: bool = True
    # output and running
    out_dir: str = ""  # default runs/datagen/<name>, relative to the project root
    overwrite: bool = False  # start over in an out_dir that holds a run with another config
    progress: bool = True

    def validate(self):
        if not self.dataset and not self.sources:
            raise UserError("config keys 'dataset' and 'sources' are both empty; set 'dataset' to a named prompt set "
                            "(gsm8k-train, alpaca, humaneval, sharegpt, ...), a .json/.jsonl file or a hub dataset "
                            f"name, or 'sources' to a mix of {', '.join(TRAINING_SETS)}")
        unread = [f"pair.{k}" for k in UNREAD_PAIR if getattr(self.pair, k) != PairParams.model_fields[k].default]
        if unread or self.pair.draft is None:
            raise UserError(f"{', '.join(unread) or 'pair.draft'}: datagen runs a draft and the target on the torch "
                            "engine with dynamic caches; name the draft, and drop the engine settings")
        if self.dataset and self.sources:
            raise UserError("config keys 'dataset' and 'sources' are both set; keep one (dataset: one prompt set, "
                            "sources: a mix of sets)")
        self.sources = [_source_entry(s) for s in self.sources]
        names = [s["name"] for s in self.sources]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise UserError(f"config key 'sources' lists {twice!r} twice; list each prompt set once")
        if self.sources and self.prompt_field:
            raise UserError("config key 'prompt_field' belongs to 'dataset'; in 'sources' give the entry its own "
                            "field, e.g. {name: my.jsonl, field: text}, and leave prompt_field empty")
        fr = (self.train_frac, self.dev_frac, self.test_frac)
        if any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
            raise UserError(f"train_frac + dev_frac + test_frac must be 1 with none negative, got {fr}")
        if not 0.0 <= self.mix_ratio <= 1.0:
            raise UserError(f"mix_ratio must be in [0, 1], got {self.mix_ratio}")
        for key in ("batch_size", "shard_size", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        for s in SPLITS:
            if getattr(self, f"max_{s}_prompts") < -1:
                raise UserError(f"max_{s}_prompts must be -1 (all), 0 (skip) or a positive cap")
        SamplingParams(self.temperature, self.top_k, self.top_p)

    def sampling(self):
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def resolved_out_dir(self) -> Path:
        return project_path(self.out_dir or f"runs/datagen/{self.name or 'datagen'}")

    def stored(self) -> dict:
        """The config as the manifest stores it (STORED_PAIR: the pair's settings flat)."""
        d = config_to_dict(self)
        pair = d.pop("pair")
        return {**d, **{k: STORED_UNSET.get(k) if pair[k] is None else pair[k] for k in STORED_PAIR}}

    @classmethod
    def from_stored(cls, stored: dict) -> "DatagenConfig":
        """The config of a manifest (stored()); keys this version does not have are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        pair = {k: stored[k] for k in STORED_PAIR if stored.get(k) not in (None, STORED_UNSET.get(k))}
        return cls(**{k: v for k, v in stored.items() if k in names}, pair=PairParams(**pair))

    def source_list(self) -> list[dict]:
        """The prompt sources as `sources` entries: `dataset` alone is a one-source mix taking all."""
        return self.sources or [{"name": self.dataset, "n": -1, "field": self.prompt_field}]


def _source_entry(s) -> dict:
    """One `sources` entry checked, in the canonical form {name, n, field}: defaults filled in, so
    `{name: mbpp}` and `{name: mbpp, n: -1}` hash alike and resume each other's runs."""
    valid = f"valid names: {', '.join(TRAINING_SETS)}, or a local .json/.jsonl file"
    if isinstance(s, str):
        s = {"name": s}
    if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not s["name"].strip():
        raise UserError(f"config key 'sources' takes entries like {{name: sharegpt, n: 3000}}, got {s!r}; {valid}")
    name = s["name"].strip()
    unknown = sorted(set(s) - set(SOURCE_KEYS))
    if unknown:
        raise UserError(f"config key 'sources': the entry for {name!r} has unknown key(s) {', '.join(unknown)}; "
                        f"valid keys: {', '.join(SOURCE_KEYS)}")
    if name in EVAL_SETS:
        raise UserError(f"config key 'sources': {name!r} is an evaluation set (the benchmarks' own prompts), and "
                        f"training on it would leak the evaluation; {valid}")
    if name not in TRAINING_SETS and not name.endswith((".json", ".jsonl")):
        raise UserError(f"config key 'sources': unknown source {name!r}; {valid}")
    n = s.get("n", -1)
    if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
        raise UserError(f"config key 'sources': n of {name!r} must be a positive number of prompts or -1 (all), "
                        f"got {n!r}")
    fld = s.get("field") or ""
    if not isinstance(fld, str):
        raise UserError(f"config key 'sources': field of {name!r} must be a field name, got {fld!r}")
    return {"name": name, "n": n, "field": fld}


def config_hash(cfg: DatagenConfig) -> str:
    d = {k: v for k, v in cfg.stored().items() if k not in UNHASHED_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------- prompts


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


def _prompts_hash(prompts: list[tuple[int, list[int]]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def _by_source(prompts: list[tuple[int, list[int]]], n_sources: int) -> list[int]:
    return [sum(1 for i, _ in prompts if i == k) for k in range(n_sources)]


# ------------------------------------------------------------------------------------ models


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


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


# -------------------------------------------------------------------------------- generation


def shard_generator(seed: int, split: str, shard: int, device) -> torch.Generator:
    """Random numbers of a shard depend on (seed, split, shard index) only: resumable."""
    s = int.from_bytes(hashlib.sha256(f"{seed}/{split}/{shard}".encode()).digest()[:8], "big") >> 1
    return torch.Generator(device=device).manual_seed(s)


def mix_tokens(x: torch.Tensor, y: torch.Tensor, r: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Z = X with probability r, else Y (token mixing). Returns (z, loss_mask: 1 where Z came from Y)."""
    keep_x = torch.rand(x.shape, generator=gen, device=x.device) < r
    return torch.where(keep_x, x, y), (~keep_x).to(torch.uint8)


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[b, L - len(s):] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # left padding: real tokens get 0, 1, 2, ... as in an unpadded run
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _step(model, ids, mask, pos, cache, vocab: int, dev) -> torch.Tensor:
    d = _input_device(model)
    out = model(input_ids=ids.to(d), attention_mask=mask.to(d), position_ids=pos.to(d), **model_kv(model, cache),
                use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].float()
    kept = getattr(model, "kept_ids", None)
    if kept is not None:  # a reduced draft vocabulary: q = 0 outside the kept tokens, as in decoding
        logits = spread_kept_logits(logits, kept[kept < vocab], vocab)
    return logits[:, :vocab].to(dev)


def _prefill(model, prompts: list[list[int]], vocab: int, dev):
    """Each prompt's own forward, then its KV right-aligned into one left-padded batch cache:
    (logits at each prompt's last token [B, vocab], per layer (keys, values) [B, heads, L, dim]).

    Why not one forward padded to the batch's longest prompt: a prefill is compute-bound, and on
    the mix's prompts (median 71 tokens, a tail to 1024) pad rows were 40% of the rows of
    length-sorted batches of 8, more for larger batches. (Prefilling runs of similar-length
    prompts together, with a little padding, measured no faster: a forward's fixed cost, the
    weights read once, about equals the pad rows it adds.) The pad slots of the cache stay zero;
    the attention mask hides them, as it hid the pad rows' KV before."""
    caches, logits = [], []
    for s in prompts:
        c = DynamicCache(config=model.config)
        ids = torch.tensor([s], dtype=torch.long)
        logits.append(_step(model, ids, torch.ones_like(ids), torch.arange(len(s))[None], c, vocab, dev))
        caches.append(c)
    L = max(len(s) for s in prompts)
    kv = []
    for i in range(len(caches[0].layers)):
        k0, v0 = caches[0].layers[i].keys, caches[0].layers[i].values
        keys = k0.new_zeros(len(prompts), k0.shape[1], L, k0.shape[3])
        values = v0.new_zeros(len(prompts), v0.shape[1], L, v0.shape[3])
        for b, c in enumerate(caches):
            n = len(prompts[b])
            keys[b, :, L - n:] = c.layers[i].keys[0]
            values[b, :, L - n:] = c.layers[i].values[0]
        kv.append((keys, values))
    return torch.cat(logits), kv


def _cache(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding copies of per-layer (keys, values): decoding appends to and
    compacts its own tensors, never these."""
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)  # an empty layer's update concatenates: a copy
    return cache


@torch.inference_mode()
def generate_batch(draft, target, prompts: list[list[int]], cfg: DatagenConfig, vocab: int, eos_ids: list[int],
                   pad_id: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Lockstep generation for one batch: per sequence x, y, z, loss_mask, accept_prob,
    expected_accept, draft_stats (and features) over its N response positions."""
    params = cfg.sampling()
    dev = gen.device
    B = len(prompts)
    _, mask = _left_pad(prompts, pad_id)
    pos = _positions(mask)
    prompt_mask = mask
    t_logits, t_kv = _prefill(target, prompts, vocab, dev)
    d_logits, d_kv = _prefill(draft, prompts, vocab, dev)
    tcache, dcache = _cache(target, t_kv), _cache(draft, d_kv)  # d_kv stays: the features pass
    del t_kv
    next_pos = pos[:, -1:] + 1
    eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
    lengths = torch.full((B,), cfg.max_new_tokens, dtype=torch.long)
    # The rows still generating (indices into the batch). A row that samples EOS leaves the batch
    # and both caches: decoding it on to max_new_tokens cost ~12% of the steps' rows at 128
    # tokens, while dropping rows from the caches is a copy of their KV, paid once per ending.
    act = torch.arange(B, device=dev)
    xs, ys, ps, es, ds = [], [], [], [], []

    def full(v: torch.Tensor, fill) -> torch.Tensor:  # active rows' values -> [B, ...]
        return torch.full((B, *v.shape[1:]), fill, dtype=v.dtype, device=v.device).index_copy_(0, act, v)

    for i in range(cfg.max_new_tokens):
        x, y, accept_prob, expected_accept, stats = _sample_position(t_logits, d_logits, params, gen)
        xs.append(full(x, pad_id))
        ys.append(full(y, pad_id))
        ps.append(full(accept_prob, 0))
        es.append(full(expected_accept, 0))
        ds.append(full(stats, 0))
        if i + 1 == cfg.max_new_tokens:
            break
        if cfg.stop_at_eos and eos.numel():
            ended = torch.isin(x, eos)
            if bool(ended.any()):
                lengths[act[ended].cpu()] = i + 1
                keep = (~ended).nonzero()[:, 0]
                if keep.numel() == 0:
                    break
                act, x, mask, next_pos = act[keep], x[keep], mask[keep.cpu()], next_pos[keep.cpu()]
                for c in (tcache, dcache):
                    c.batch_select_indices(keep.to(c.layers[0].keys.device))
        # feed X_i to both models
        mask = torch.cat([mask, torch.ones((len(act), 1), dtype=mask.dtype)], dim=1)
        t_logits = _step(target, x[:, None], mask, next_pos, tcache, vocab, dev)
        d_logits = _step(draft, x[:, None], mask, next_pos, dcache, vocab, dev)
        next_pos = next_pos + 1
    del tcache, dcache
    X, Y = torch.stack(xs, 1), torch.stack(ys, 1)
    P, E = torch.stack(ps, 1), torch.stack(es, 1)
    Z, loss_mask = mix_tokens(X, Y, cfg.mix_ratio, gen)
    feats = _draft_features(draft, _cache(draft, d_kv), pos[:, -1:] + 1, prompt_mask, Z) \
        if cfg.store_features else None
    X, Y, Z, P, E, loss_mask, D = (t.cpu() for t in (X, Y, Z, P, E, loss_mask, torch.stack(ds, 1)))
    return _split_sequences(prompts, lengths, X, Y, Z, P, E, loss_mask, D, feats)


def _sample_position(t_logits, d_logits, params, gen: torch.Generator):
    """One response position of the batch: X_i ~ p_i, Y_i ~ q_i, the probability that Y_i is
    accepted, min(1, p(Y_i)/q(Y_i)), its expectation over Y_i, 1 - TV(p_i, q_i), and
    draft_stats(q_i, Y_i) [B, 3].

    q is the processed distribution (temperature, top-k, top-p) that Y_i is drawn from: the
    decoder's q, the one its stop rules and heads see when drafting. Its statistics are taken at
    Y_i, not Z_i: Z_i = Y_i wherever the loss is taken, and X_i may lie outside q's support
    (log q = -inf) where it is not."""
    p = process_logits(t_logits, params)
    q = process_logits(d_logits, params)
    x = sample(p, gen)  # X_i ~ p_i: the target's response
    y = sample(q, gen)  # Y_i ~ q_i: the draft's candidate at the same position
    p_y = p.gather(-1, y[:, None])[:, 0]
    q_y = q.gather(-1, y[:, None])[:, 0]  # > 0: y was drawn from q
    return x, y, (p_y / q_y).clamp(max=1.0), torch.minimum(p, q).sum(-1), draft_stats(q, y)  # 1 - TV(p, q)


def _split_sequences(prompts, lengths, X, Y, Z, P, E, loss_mask, D, feats) -> list[dict[str, torch.Tensor]]:
    """Per sequence b, its first lengths[b] positions (tokens past its EOS dropped)."""
    seqs = []
    for b in range(len(prompts)):
        n = int(lengths[b])
        seqs.append({"prompt": torch.tensor(prompts[b], dtype=torch.int32), "x": X[b, :n].to(torch.int32),
                     "y": Y[b, :n].to(torch.int32), "z": Z[b, :n].to(torch.int32),
                     "loss_mask": loss_mask[b, :n].contiguous(), "accept_prob": P[b, :n].float(),
                     "expected_accept": E[b, :n].float(), "draft_stats": D[b, :n].float().contiguous()})
        if feats is not None:
            seqs[-1]["features"] = feats[b, :n].contiguous()
    return seqs


def _draft_features(draft, prompt_cache, first_pos, prompt_mask, Z) -> torch.Tensor:
    """The draft's final hidden state (after the final norm) at the positions whose input tokens
    are Z_1..Z_n, i.e. over the sequence (prompt, Z). bf16 [B, n, H].

    `prompt_cache` holds the (padded) prompt from the prefill, so only Z is fed, which saves the
    prompt's share of this pass. Rows that ended early carry trailing pad tokens past their EOS;
    the pass is causal, so those do not touch earlier positions.
    """
    B, n = Z.shape
    mask = torch.cat([prompt_mask, torch.ones((B, n), dtype=prompt_mask.dtype)], dim=1)
    pos = first_pos + torch.arange(n)
    d = _input_device(draft)
    h = draft.base_model(input_ids=Z.to(d), attention_mask=mask.to(d), position_ids=pos.to(d),
                         **model_kv(draft.base_model, prompt_cache), use_cache=True).last_hidden_state
    return h.to(torch.bfloat16).cpu()


def pack_shard(seqs: list[dict[str, torch.Tensor]], store_features: bool) -> dict[str, torch.Tensor]:
    """Concatenate per-sequence arrays into the shard tensors of the v1 format."""
    def offsets(lens):
        return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)

    resp_lens = [len(s["z"]) for s in seqs]
    t = {
        "input_ids": torch.cat([torch.cat([s["prompt"], s["z"]]) for s in seqs]).to(torch.int32),
        "input_offsets": offsets([len(s["prompt"]) + len(s["z"]) for s in seqs]),
        "prompt_lens": torch.tensor([len(s["prompt"]) for s in seqs], dtype=torch.int32),
        "source_ids": torch.tensor([s["source"] for s in seqs], dtype=torch.int32),
        "resp_offsets": offsets(resp_lens),
        "x_ids": torch.cat([s["x"] for s in seqs]),
        "y_ids": torch.cat([s["y"] for s in seqs]),
        "z_ids": torch.cat([s["z"] for s in seqs]),
        "loss_mask": torch.cat([s["loss_mask"] for s in seqs]).to(torch.uint8),
        "accept_prob": torch.cat([s["accept_prob"] for s in seqs]).to(torch.float32),
        "expected_accept": torch.cat([s["expected_accept"] for s in seqs]).to(torch.float32),
        "draft_stats": torch.cat([s["draft_stats"] for s in seqs]).to(torch.float32),
    }
    if store_features:
        t["features"] = torch.cat([s["features"] for s in seqs]).to(torch.bfloat16)
    return {k: v.contiguous() for k, v in t.items()}


# ----------------------------------------------------------------------------------- storage


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict):
    """Atomic write. All metadata goes into ONE key as sorted JSON: safetensors stores the
    metadata map in hash order, which would break byte-identical reruns with several keys."""
    atomic_write(path, save(tensors, metadata={_META_KEY: json.dumps(meta, sort_keys=True)}))


def shard_meta(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get(_META_KEY, "{}"))


def load_shard(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one shard file (see the module docstring for their meaning)."""
    return load_file(str(path))


def iter_shards(out_dir: str | Path, split: str) -> Iterator[dict[str, torch.Tensor]]:
    """The shards of `split` listed in out_dir/manifest.json, in order, loaded one at a time."""
    out_dir = Path(out_dir)
    man = read_manifest(out_dir, hint="point at a folder written by `adaptive-spec datagen`")
    if split not in man["splits"]:
        raise UserError(f"split {split!r} is not in {out_dir}; it has {', '.join(man['splits'])}")
    for sh in man["splits"][split]["shards"]:
        yield load_shard(out_dir / sh["file"])


def shard_file(split: str, k: int) -> str:
    return f"{split}/shard-{k:05d}.safetensors"


def _n_shards(n_prompts: int, shard_size: int) -> int:
    return -(-n_prompts // shard_size)


COUNTS = ("n_prompts", "n_tokens", "n_loss_tokens")


def build_manifest(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict) -> dict:
    """The manifest as the folder stands: every finished shard file, in index order, and the
    counts per split and per source."""
    srcs = [{**src, "splits": {s: dict.fromkeys(COUNTS, 0) for s in SPLITS}} for src in cfg.source_list()]
    splits, complete = {}, True
    for s in SPLITS:
        entry = {**dict.fromkeys(COUNTS, 0), "shards": []}
        for k in range(planned[s]["n_shards"]):
            f = shard_file(s, k)
            if not (out_dir / f).is_file():
                complete = False
                continue
            m = shard_meta(out_dir / f)
            entry["shards"].append({"file": f, "n_seqs": m["n_seqs"], "n_tokens": m["n_tokens"],
                                    "n_loss_tokens": m["n_loss_tokens"]})
            for a, b in zip(COUNTS, ("n_seqs", "n_tokens", "n_loss_tokens")):
                entry[a] += m[b]
            for src, counts in zip(srcs, m.get("by_source", [])):
                for a, c in zip(COUNTS, counts):
                    src["splits"][s][a] += c
        splits[s] = entry
    return {"format": FORMAT, "config": cfg.stored(), "config_hash": config_hash(cfg), "seed": cfg.seed,
            "models": models, "splits": splits, "sources": srcs, "planned": planned, "complete": complete}


def write_manifest(out_dir: Path, manifest: dict):
    write_json(out_dir / "manifest.json", manifest)


def _identity(config: dict, models: dict, planned: dict) -> dict:
    """What a run's shards depend on: the hashed config keys, the weights, the prompts of each split."""
    d = {k: v for k, v in config.items() if k not in UNHASHED_KEYS}
    d.update({f"{r} weights": (models.get(r) or {}).get("fingerprint") for r in ("draft", "target")})
    d.update({f"{s} prompts": (planned.get(s) or {}).get("prompts_hash") for s in SPLITS})
    return d


def _existing_run(out_dir: Path) -> dict | None:
    """The manifest of the datagen run in out_dir, None for an empty or missing folder; a folder
    holding anything else is refused."""
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return None
    man = read_manifest(out_dir, required=False, hint="delete it or choose another out_dir")
    if man is None or man.get("format") != FORMAT:
        raise UserError(f"out_dir {out_dir} is not empty and holds no datagen run; choose another out_dir")
    return man


def check_draft_config(out_dir: Path, cfg: DatagenConfig):
    """Refuse to resume a run made for another draft configuration, before any model loads.

    Heads are trained for the draft they serve (its q, its hidden states): shards of two draft
    configurations in one dataset would silently mix two training sets."""
    man = None if cfg.overwrite else _existing_run(out_dir)
    old, new = (man or {}).get("config") or {}, cfg.stored()
    diff = [f"{k}: {old.get(k)!r} there, {new[k]!r} now" for k in DRAFT_KEYS
            if man is not None and old.get(k) != new[k]]
    if diff:
        raise UserError(f"out_dir {out_dir} holds a datagen run made with another draft configuration "
                        f"({'; '.join(diff)}); one dataset serves one draft configuration: choose another out_dir "
                        "for this one, or pass overwrite=true to replace that run")


def _check_out_dir(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict) -> bool:
    """Whether out_dir must be wiped first (overwrite=true); refuses a run of another config."""
    man = _existing_run(out_dir)
    if man is None:
        return False
    if cfg.overwrite:
        return True
    old = _identity(man.get("config", {}), man.get("models", {}), man.get("planned", {}))
    problem = settings_problem(out_dir, old, _identity(cfg.stored(), models, planned), "datagen run")
    if problem:
        raise UserError(f"{problem}; pass the same config to resume it, choose another out_dir, or pass "
                        "overwrite=true to start over")
    return False


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
    planned = {s: {"n_prompts": len(plan[s]), "n_shards": _n_shards(len(plan[s]), cfg.shard_size),
                   "prompts_hash": _prompts_hash(plan[s]), "by_source": _by_source(plan[s], n_src)} for s in SPLITS}
    _prepare_out_dir(out_dir, cfg, models, planned, state)

    eos_ids, pad_id = eos_and_pad(tok, target)
    gen_device = device if not cfg.target_device_map else _input_device(draft)
    todo = _todo_shards(out_dir, planned, state)
    progress = _Progress(cfg, state, out_dir, plan, planned, todo)
    for s, k in todo:
        chunk = plan[s][k * cfg.shard_size:(k + 1) * cfg.shard_size]
        gen = shard_generator(cfg.seed, s, k, gen_device)
        seqs = generate_shard(draft, target, [e for _, e in chunk], cfg, vocab, eos_ids, pad_id, gen,
                               progress.batch_done)
        for seq, (i, _) in zip(seqs, chunk):
            seq["source"] = i
        meta = _save_shard(out_dir, s, k, seqs, cfg, n_src)
        if state.is_main:
            write_manifest(out_dir, build_manifest(out_dir, cfg, models, planned))
        progress.shard_done(shard_file(s, k), meta)
    progress.close()
    state.barrier()
    return _finish(out_dir, cfg, models, planned, state)


def _prepare_out_dir(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict, state: "_State"):
    """Refuse a folder of another run, wipe it with overwrite=true, write the manifest, drop the
    half-written shards of a killed run."""
    wipe = _check_out_dir(out_dir, cfg, models, planned)  # every process checks; only main mutates
    state.barrier()  # nobody may still be reading out_dir while the main process wipes it
    if state.is_main:
        if wipe:
            shutil.rmtree(out_dir)
        # the manifest first: a folder with anything else in it is then always recognisable
        out_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(out_dir, build_manifest(out_dir, cfg, models, planned))
        for s in SPLITS:
            (out_dir / s).mkdir(exist_ok=True)
            for stale in (out_dir / s).glob(".*.tmp.*"):
                stale.unlink()
    state.barrier()


def _todo_shards(out_dir: Path, planned: dict, state: "_State") -> list[tuple[str, int]]:
    """(split, shard index) of this process still missing on disk. The small evaluation splits
    first: a partial run is then already usable (dev + some train)."""
    return [(s, k) for s in WORK_ORDER for k in range(planned[s]["n_shards"])
            if k % state.world == state.index and not (out_dir / shard_file(s, k)).is_file()]


def eos_and_pad(tok, target) -> tuple[list[int], int]:
    """The ids that end a response, and the id that left-pads a batch."""
    eos_ids = eos_token_ids(tok, target)
    return eos_ids, tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)


def generate_shard(draft, target, prompts, cfg, vocab, eos_ids, pad_id, gen, on_batch) -> list[dict]:
    """The sequences of one shard, in file order; batches hold prompts of similar length (less
    padding in the prefill)."""
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
    seqs: list = [None] * len(prompts)
    for b in range(0, len(order), cfg.batch_size):
        idx = order[b:b + cfg.batch_size]
        batch = generate_batch(draft, target, [prompts[j] for j in idx], cfg, vocab, eos_ids, pad_id, gen)
        for j, seq in zip(idx, batch):
            seqs[j] = seq
        on_batch(batch)
    return seqs


def _save_shard(out_dir: Path, split: str, k: int, seqs: list[dict], cfg: DatagenConfig, n_sources: int) -> dict:
    tensors = pack_shard(seqs, cfg.store_features)
    by_source = [[0, 0, 0] for _ in range(n_sources)]  # [n_seqs, n_tokens, n_loss_tokens] per source
    for q in seqs:
        c = by_source[q["source"]]
        c[0], c[1], c[2] = c[0] + 1, c[1] + len(q["z"]), c[2] + int(q["loss_mask"].sum())
    meta = {"split": split, "shard": k, "n_seqs": len(seqs), "n_tokens": int(tensors["z_ids"].numel()),
            "n_loss_tokens": int(tensors["loss_mask"].sum()), "config_hash": config_hash(cfg), "by_source": by_source}
    _write_shard(out_dir / shard_file(split, k), tensors, meta)
    return meta


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

    def close(self):
        self.bar.close()


def _finish(out_dir: Path, cfg: DatagenConfig, models: dict, planned: dict, state: "_State") -> dict:
    man = build_manifest(out_dir, cfg, models, planned)
    if state.is_main:
        write_manifest(out_dir, man)
        log.info(f"datagen: done: {out_dir} complete={man['complete']}; " + ", ".join(
            f"{s} {man['splits'][s]['n_prompts']} prompts / {man['splits'][s]['n_tokens']} tokens" for s in SPLITS))
    return man


INTERRUPTED = "finished shards are kept; rerun the same command to resume"


def _main(argv) -> int:
    cfg = config_from_argv(DatagenConfig, argv, "adaptive-spec datagen", __doc__.split("\n\n")[0], "datagen")
    run(cfg)
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
