"""Acceptance-head data for the feature drafter: `adaptive-spec datagen-drafter`.

A head reads the draft's state after it consumed a candidate Y_i and predicts min(1, p_i(Y_i) / q_i(Y_i)).
A draft model's state depends on the prefix alone, so datagen gets both from one lockstep rollout. The feature
drafter's state also depends on where the round began: its first step reads the target's state f, every later
one its own f^ (drafter/source.py). So this data simulates rounds of every depth d = 1..D at once, along
sequences whose target states the drafter's trainer has computed already (its states folder), one pass of the
drafter's layer per level:

  level 1   slot j reads (f_j, x_{j+1}) and gives f^1_{j+1}, whose readout is q at position j + 2;
  level L   slot j reads (f^{L-1}_j, Z^{L-1}_{j+1}), attending what decoding's cache holds at that step: the
            level-1 keys of slots <= j - L + 1 (the round's verified prefix) and the level-m key of slot
            j - L + m for m = 2..L (the round's drafted tokens, itself last): level_mask.

The depth-d candidates are Y^d_i ~ q^d_i (level d's readout at slot i - 2), labelled with the target's p_i at
the same position, and mixed into the sequence as datagen mixes them (Z^d_i = Y^d_i, or the sequence's own
token with probability mix_ratio: the loss is taken where Z = Y). The head's input for Y^d_i is level d + 1's
f^ at slot i - 1: what FeatureRunner hands the decoder after feeding Y^d_i. p_i is conditioned on the
sequence's own prefix, not on the round's earlier candidates: datagen's approximation (heads/features.py).

Each depth of each sequence is stored as one datagen sequence (the tokens before its first candidate as the
prompt, Z^d as the response), so the head trainer reads the folder as any datagen run (shards.py, format v1).
A shard (one per states shard) is written atomically and is the unit of resume; a folder made with other
settings is refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..backends.logits import process_logits
from ..decoding.sampling import SamplingParams, sample
from ..errors import UserError, get_logger
from ..runs import fill_shards, project_path, read_manifest
from .batched import acceptance, mix_tokens
from .config import WORK_ORDER
from .generate import shard_generator
from .shards import SPLITS, existing_manifest, folder_manifest, save_shard, shard_file

log = get_logger(__name__)
KIND = "feature-rounds"


def level_mask(n: int, level: int) -> torch.Tensor:
    """[n, level * n] bool: which keys (levels 1..level, n slots each, in cache order) slot j of `level` attends.
    A slot too early for its level (j < level - 1) attends only itself: its output is never read."""
    j = torch.arange(n)
    allow = torch.zeros(n, level * n, dtype=torch.bool)
    allow[:, :n] = j[None, :] <= (j - level + 1)[:, None]
    for m in range(2, level + 1):
        k = j - level + m
        ok = k >= 0
        allow[j[ok], (m - 1) * n + k[ok]] = True
    allow[: level - 1] = False
    allow[j, (level - 1) * n + j] = True
    return allow


@torch.inference_mode()
def simulate(drafter, readout, ids: torch.Tensor, feats: torch.Tensor, start: int, depth: int,
             params: SamplingParams, mix_ratio: float, gen: torch.Generator) -> list[dict]:
    """One sequence's head examples for depths 1..depth: per depth a dict in datagen's sequence layout
    (shards.pack_shard), its response the positions from max(start, depth + 1) on. ids [T], feats [T, H] the
    target's states along ids."""
    T, n = len(ids), len(ids) - 1
    first = max(start, depth + 1)
    if first >= T:
        return []
    pos = torch.arange(n).view(1, n)
    cache = DynamicCache(config=drafter.config_obj)
    p = process_logits(readout.full_logits(feats[first - 1: T - 1]), params)  # p_i for i = first..T-1
    f_in, toks, out = feats[:-1], ids[1:], []
    for level in range(1, depth + 2):
        h = drafter(f_in.view(1, n, -1).to(drafter.dtype), readout.embed(toks).view(1, n, -1), pos, cache=cache,
                    use_cache=True, attention_mask=level_mask(n, level)[None, None])
        g = readout.feature(h[0])  # f^ of every slot at this level
        if level > 1:
            out[-1]["features"] = g[first - 1: T - 1].to(torch.bfloat16)
        if level == depth + 1:
            break
        q = process_logits(readout.logits(g[first - 2: T - 2]), params)
        y = sample(q, gen)
        z, loss_mask = mix_tokens(ids[first:], y, mix_ratio, gen)
        accept_prob, expected_accept, stats = acceptance(p, q, y)
        out.append({"prompt": ids[:first].to(torch.int32), "x": ids[first:].to(torch.int32),
                    "y": y.to(torch.int32), "z": z.to(torch.int32), "loss_mask": loss_mask, "accept_prob": accept_prob,
                    "expected_accept": expected_accept, "draft_stats": stats, "source": 0})
        f_in = torch.cat([feats[:1], g[:-1].to(feats.dtype)])  # slot j reads this level's f^ of slot j - 1
        toks = torch.cat([ids[1:first], z])
    return out


def states_manifest(states: Path) -> dict:
    """The drafter states folder's manifest, or a UserError saying what to point --states at."""
    man = read_manifest(states, hint="compute the drafter's states first (accelerate launch train.py --config "
                                     "configs/train/drafter_*.yaml builds them)")
    if not str(man.get("format", "")).startswith("adaptive_spec.drafter_data"):
        raise UserError(f"{states} holds no drafter states (format {man.get('format')!r}); point --states at the "
                        "states folder of a drafter run (its config's states_dir, or <output_dir>/states)")
    return man


def plan(states: Path, man: dict, max_seqs: dict[str, int]) -> list[tuple[str, int, str, int]]:
    """(split, k, states shard, its sequence count) per output shard, the evaluation split first: whole states
    shards until a split has max_seqs (0: all), so a larger max_seqs extends a folder rather than changing it."""
    jobs = []
    for split in (s for s in WORK_ORDER if s in man["splits"]):
        taken, most = 0, max_seqs.get(split, 0)
        for k, f in enumerate(man["splits"][split]["shards"]):
            if most and taken >= most:
                break
            with safe_open(str(states / f), framework="pt") as fh:  # the header alone, not the states
                n = fh.get_slice("offsets").get_shape()[0] - 1
            jobs.append((split, k, f, n))
            taken += n
    return jobs


def _load(drafter_path: str, states_man: dict, dtype: str):
    """(the drafter, its readout over the vocabulary it decodes with, that vocabulary) on the CPU."""
    from ..backends.models import load_model
    from ..backends.vocab import resolve_draft_vocab
    from ..drafter.model import Readout
    from ..drafter.source import load_drafter, readout_vocab

    target = states_man["target"]
    model, tok = load_model(target["name"], "target", dtype, "cpu", pack=False)
    model.base_model.layers = torch.nn.ModuleList()  # the readout needs the embedding, norm and LM head alone
    drafter = load_drafter(drafter_path, hidden_size=model.config.hidden_size)
    drafter = drafter.to(dtype=model.get_input_embeddings().weight.dtype).eval()
    vocab = readout_vocab(drafter)
    kept = resolve_draft_vocab(vocab, tok, model.get_output_embeddings().out_features)
    return drafter, Readout(model, kept_ids=kept), vocab


def build(drafter_path: str, states: str | Path, out: str | Path, depth: int = 3, mix_ratio: float = 0.15,
          params: SamplingParams | None = None, seed: int = 0, max_seqs: dict | None = None, dtype: str = "auto",
          progress: bool = True, stop_after: int = 0) -> dict:
    """Write the head data of `drafter_path` along the states folder `states` into `out`; returns its manifest.
    stop_after: stop after writing that many shards (a kill, for the tests)."""
    from ..backends.runner import model_fingerprint

    if depth < 1:
        raise UserError(f"--depth is the deepest drafted step simulated, at least 1; got {depth}")
    if not 0.0 <= mix_ratio <= 1.0:
        raise UserError(f"--mix-ratio must be in [0, 1], got {mix_ratio}")
    params = params or SamplingParams(1.0, 50, 1.0)
    states, out = project_path(states), project_path(out)
    max_seqs = {s: int((max_seqs or {}).get(s, 0)) for s in ("train", "dev")}
    states_man = states_manifest(states)
    jobs = plan(states, states_man, max_seqs)
    drafter, readout, vocab = _load(drafter_path, states_man, dtype)
    fp = "feature-" + model_fingerprint(drafter.base)
    config = {"kind": KIND, "drafter": drafter_path, "drafter_fingerprint": fp, "states": str(states), "depth": depth,
              "mix_ratio": mix_ratio, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
              "seed": seed, "draft_quant": "none", "draft_vocab": vocab}
    chash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    config["max_seqs"] = max_seqs  # a shard does not depend on how many there are
    old = existing_manifest(out, f"--out {out} is not empty and holds no head data; choose another folder")
    if old is not None and old.get("config_hash") != chash:
        raise UserError(f"{out} holds head data made with other settings ({old.get('config')}); rerun with those, "
                        "or choose another --out")
    models = {"draft": {"name": f"feature:{drafter_path}", "hidden_size": drafter.hidden_size,
                        "vocab_size": readout.vocab_size, "fingerprint": fp}, "target": states_man["target"]}
    planned = {s: {"n_prompts": sum(j[3] for j in jobs if j[0] == s), "n_shards": sum(1 for j in jobs if j[0] == s)}
               for s in SPLITS}

    def manifest() -> dict:
        return folder_manifest(out, config=config, config_hash=chash, seed=seed, sources=[{"name": KIND, "n": -1}],
                               models=models, planned=planned)

    todo = [j for j in jobs if not (out / shard_file(j[0], j[1])).is_file()]
    with tqdm(total=sum(j[3] for j in todo), unit="seq", disable=not progress, desc="drafter rounds") as bar:
        for split, k, f, n in fill_shards(out, todo, manifest, stop_after, first=True):
            t = load_file(str(states / f))
            off, gen, seqs = t["offsets"].tolist(), shard_generator(seed, split, k, "cpu"), []
            for s in range(n):
                a, b = off[s], off[s + 1]
                seqs += simulate(drafter, readout, t["input_ids"][a:b].long(), t["hidden"][a:b],
                                 int(t["resp_starts"][s]), depth, params, mix_ratio, gen)
                bar.update(1)
            save_shard(out, split, k, seqs, True, chash)
    return read_manifest(out)


def _main(argv) -> int:
    from ..cli_args import Parser

    ap = Parser(prog="adaptive-spec datagen-drafter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="the feature drafter the head will serve (folder or hub id)")
    ap.add_argument("--states", required=True, help="the target's states folder of a drafter run "
                    "(e.g. runs/drafter/cpu_all/states: its config's states_dir)")
    ap.add_argument("--out", required=True, help="datagen folder to write (e.g. runs/datagen/drafter-rounds)")
    ap.add_argument("--depth", type=int, default=3, help="deepest drafted step simulated (default 3)")
    ap.add_argument("--max-train-seqs", type=int, default=0, help="states sequences used for training (0: all)")
    ap.add_argument("--max-dev-seqs", type=int, default=0, help="states sequences used for dev (0: all)")
    ap.add_argument("--mix-ratio", type=float, default=0.15, help="r: share of candidates replaced by the "
                    "sequence's own token (no loss there), as datagen's token mixing (default 0.15)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling of the candidates and labels (1.0)")
    ap.add_argument("--top-k", type=int, default=50, help="(50, datagen's)")
    ap.add_argument("--top-p", type=float, default=1.0, help="(1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="auto: bf16 on a CPU with bf16 kernels, else fp32 (the drafter's decoding dtype)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    man = build(a.drafter, a.states, a.out, a.depth, a.mix_ratio, SamplingParams(a.temperature, a.top_k, a.top_p),
                a.seed, {"train": a.max_train_seqs, "dev": a.max_dev_seqs}, a.dtype, not a.no_progress)
    counts = {s: (v["n_prompts"], v["n_loss_tokens"]) for s, v in man["splits"].items() if v["n_prompts"]}
    log.info(f"{a.out}: " + ", ".join(f"{s} {n} sequences, {m} loss positions" for s, (n, m) in counts.items()))
    return 0


def main(argv=None) -> int:
    from ..errors import run_main

    return run_main(_main, argv, "finished shards are kept; rerun the same command to resume")
