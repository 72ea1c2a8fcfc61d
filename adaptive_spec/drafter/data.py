"""The feature drafter's training data: the target's final hidden states along sequences, computed once.

The sequences are a datagen run's (adaptive_spec/datagen/shards.py): each prompt followed by its response Z,
text the target itself sampled (a mix_ratio share of its tokens are the draft's; the target's states along it
are what the drafter will read in decoding either way). Each prompt is cut to its last `prompt_tail` tokens:
the drafter drafts responses, and a long prompt would otherwise fill the data with prompt positions.

    out_dir/manifest.json   {"format", "settings" (what the states depend on), "target": {name, hidden_size,
                             fingerprint}, "splits": {split: {"shards": [file], n_seqs, n_tokens}}, "complete"}
    out_dir/<split>/hidden-NNNNN.safetensors, one per source shard:
        input_ids   [N] int32     the sequences, concatenated
        offsets     [S + 1] int64 sequence s is input_ids[offsets[s]:offsets[s + 1]]
        resp_starts [S] int32     where each sequence's response starts
        hidden      [N, H] bf16   the target's final hidden state (after its final norm) at each position

A shard is written atomically and is the unit of resume: rerunning the same call skips the shards that exist
(the manifest is rebuilt from the folder after each one), and a folder made with other settings is refused.
The target runs once per sequence, in bf16 on a CPU with bf16 kernels (backends/cpu.py), else in fp32.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from ..errors import UserError, get_logger
from ..runs import atomic_write, check_settings, read_manifest, write_json

log = get_logger(__name__)

FORMAT = "adaptive_spec.drafter_data.v1"
SPLITS = ("train", "dev")
_META = "adaptive_spec.drafter_data"


def plan(source: str | Path, max_seqs: dict) -> dict:
    """{split: [(source shard file, sequences to take)]}: the source's shards in order, up to max_seqs[split]
    sequences (0: all) per split."""
    man = read_manifest(source, hint="point `data` at a folder written by `adaptive-spec datagen`")
    out = {}
    for split in SPLITS:
        left, todo = max_seqs.get(split, 0) or None, []
        for sh in (man.get("splits", {}).get(split) or {}).get("shards", []):
            if left is not None and left <= 0:
                break
            n = sh["n_seqs"] if left is None else min(sh["n_seqs"], left)
            todo.append((sh["file"], n))
            left = None if left is None else left - n
        out[split] = todo
    return out


def sequences(shard: dict, n: int, prompt_tail: int, max_len: int) -> list[tuple[torch.Tensor, int]]:
    """(ids, response start) of the first n sequences of a datagen shard, each prompt cut to its last
    prompt_tail tokens and the whole to max_len."""
    out = []
    for s in range(n):
        a, b = int(shard["input_offsets"][s]), int(shard["input_offsets"][s + 1])
        p = int(shard["prompt_lens"][s])
        keep = min(p, prompt_tail)
        ids = shard["input_ids"][a + p - keep: b][:max_len].long()
        out.append((ids, keep))
    return out


@torch.inference_mode()
def target_states(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states along ids [T] -> [T, H] bf16."""
    dev = next(model.parameters()).device
    return model.base_model(input_ids=ids.view(1, -1).to(dev)).last_hidden_state[0].to(torch.bfloat16).cpu()


def write_shard(path: Path, seqs: list[tuple[torch.Tensor, int]], hidden: list[torch.Tensor]) -> None:
    lens = [len(ids) for ids, _ in seqs]
    t = {"input_ids": torch.cat([ids for ids, _ in seqs]).to(torch.int32),
         "offsets": torch.tensor([0] + lens, dtype=torch.int64).cumsum(0),
         "resp_starts": torch.tensor([r for _, r in seqs], dtype=torch.int32),
         "hidden": torch.cat(hidden).contiguous()}
    meta = {"n_seqs": len(seqs), "n_tokens": sum(lens)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, save(t, metadata={_META: json.dumps(meta, sort_keys=True)}))


def shard_name(split: str, k: int) -> str:
    return f"{split}/hidden-{k:05d}.safetensors"


def folder_manifest(out_dir: Path, settings: dict, target: dict, todo: dict) -> dict:
    splits, complete = {}, True
    for split, shards in todo.items():
        entry = {"shards": [], "n_seqs": 0, "n_tokens": 0}
        for k in range(len(shards)):
            f = out_dir / shard_name(split, k)
            if not f.is_file():
                complete = False
                continue
            with safe_open(str(f), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {}).get(_META, "{}"))
            entry["shards"].append(shard_name(split, k))
            entry["n_seqs"] += meta["n_seqs"]
            entry["n_tokens"] += meta["n_tokens"]
        splits[split] = entry
    return {"format": FORMAT, "settings": settings, "target": target, "splits": splits, "complete": complete}


def build(source: str | Path, out_dir: str | Path, load_target, settings: dict, max_seqs: dict,
          prompt_tail: int = 128, max_len: int = 512, progress: bool = True, stop_after: int = 0) -> dict:
    """Compute the target's states for the planned sequences into out_dir; returns the manifest.

    load_target() -> (model, {name, hidden_size, fingerprint}) is called only when a shard is missing.
    `settings`: what the states depend on (source, target, dtype, cuts); a folder made with others is refused.
    stop_after: stop after writing that many shards (a kill, for the tests)."""
    out_dir, source = Path(out_dir), Path(source)
    settings = {**settings, "source": str(source), "prompt_tail": prompt_tail, "max_len": max_len,
                "max_seqs": {s: max_seqs.get(s, 0) for s in SPLITS}}
    old = read_manifest(out_dir, required=False)
    if old is not None:
        check_settings(out_dir, old.get("settings", {}), settings, kind="hidden-state set",
                       fix="rerun with the settings it was made with, or choose another folder")
        if old.get("complete"):
            return old
    todo = plan(source, max_seqs)
    missing = [(s, k, f, n) for s, shards in todo.items() for k, (f, n) in enumerate(shards)
               if not (out_dir / shard_name(s, k)).is_file()]
    model, target = (None, old["target"]) if old is not None else (None, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tqdm(total=sum(n for *_, n in missing), unit="seq", disable=not progress, desc="target states") as bar:
        for i, (split, k, f, n) in enumerate(missing):
            if model is None:
                model, target = load_target()
                write_json(out_dir / "manifest.json", folder_manifest(out_dir, settings, target, todo))
            seqs = sequences(load_file(str(source / f)), n, prompt_tail, max_len)
            hidden = []
            for ids, _ in seqs:
                hidden.append(target_states(model, ids))
                bar.update(1)
            write_shard(out_dir / shard_name(split, k), seqs, hidden)
            write_json(out_dir / "manifest.json", folder_manifest(out_dir, settings, target, todo))
            if stop_after and i + 1 >= stop_after:
                return read_manifest(out_dir)
    man = folder_manifest(out_dir, settings, target, todo)
    write_json(out_dir / "manifest.json", man)
    return man


def load_split(out_dir: str | Path, split: str) -> list[dict]:
    """Every sequence of a split: [{"ids" [T] long, "resp_start", "hidden" [T, H] bf16}]."""
    out_dir = Path(out_dir)
    man = read_manifest(out_dir, hint="compute the states first (the drafter's training config does)")
    seqs = []
    for f in man["splits"].get(split, {}).get("shards", []):
        t = load_file(str(out_dir / f))
        off = t["offsets"].tolist()
        for s in range(len(off) - 1):
            a, b = off[s], off[s + 1]
            seqs.append({"ids": t["input_ids"][a:b].long(), "resp_start": int(t["resp_starts"][s]),
                         "hidden": t["hidden"][a:b]})
    if not seqs and split == "train":
        raise UserError(f"{out_dir} holds no training sequences; check the datagen folder it was built from")
    return seqs
