"""The datagen shard format (v1): the contract between `adaptive-spec datagen` and everything that
reads its output (training, `autotune`, `datagen-features`, eval/). A change here is a format
change: bump FORMAT, and teach the readers (adaptive_spec/training/data.py) both. See also
docs/datagen.md; the quantities themselves are defined in adaptive_spec/datagen/generate.py.

  out_dir/manifest.json  {"format": "adaptive_spec.datagen.v1", "config", "config_hash", "seed",
                          "models": {"draft"|"target": {name, hidden_size, vocab_size, fingerprint}},
                          "splits": {split: {n_prompts, n_tokens, n_loss_tokens,
                                             shards: [{file, n_seqs, n_tokens, n_loss_tokens}]}},
                          "sources": [{name, n, field, splits: {split: {n_prompts, n_tokens, n_loss_tokens}}}],
                          "planned": {split: {n_prompts, n_shards, prompts_hash, by_source}},
                          "complete" [, "features": {from, dtype, prefix, ...}: a datagen-features folder]}
  out_dir/<split>/shard-NNNNN.safetensors, split in SPLITS, NNNNN the shard index; for S sequences
  with P prompt tokens and T response tokens in all (sequence s's response is positions
  resp_offsets[s]:resp_offsets[s + 1]):
    input_ids        [P + T] int32    per sequence its prompt then its response Z, concatenated
    input_offsets    [S + 1] int64    sequence s is input_ids[input_offsets[s]:input_offsets[s + 1]]
    prompt_lens      [S]     int32
    source_ids       [S]     int32    an index into the manifest's "sources"
    resp_offsets     [S + 1] int64
    x_ids, y_ids, z_ids  [T] int32    X (the target's response), Y (the draft's candidates), Z (mixed)
    loss_mask        [T]     uint8    1 where Z_i came from Y_i
    accept_prob      [T]     float32  min(1, p_i(Y_i) / q_i(Y_i))
    expected_accept  [T]     float32  1 - TV(p_i, q_i)
    draft_stats      [T, 3]  float32  log q_i(Y_i), entropy of q_i, top-1 minus top-2 probability
    features         [T, H]  bf16     the draft's final hidden state (only with store_features;
                                      datagen-features adds it, and `context_features`, later)
  and one safetensors metadata key, "adaptive_spec.datagen": sorted JSON {split, shard, n_seqs,
  n_tokens, n_loss_tokens, config_hash, by_source: [[n_seqs, n_tokens, n_loss_tokens] per source]}.
n_tokens counts response tokens (T), n_loss_tokens those with loss_mask 1. A shard is written
atomically and is the unit of resume: the manifest lists the finished ones."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file

from ..errors import UserError
from ..runs import read_manifest, save_tensors, tensors_meta, write_json

FORMAT = "adaptive_spec.datagen.v1"
SPLITS = ("train", "dev", "test")
COUNTS = ("n_prompts", "n_tokens", "n_loss_tokens")
META_KEY = "adaptive_spec.datagen"  # the single safetensors metadata key (runs.save_tensors)


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


def save_shard(out_dir: Path, split: str, k: int, seqs: list[dict], store_features: bool, config_hash: str,
               n_sources: int = 1) -> dict:
    """Pack the sequences (each with its "source" index) into shard k of `split`, written atomically; its metadata."""
    by_source = [[0, 0, 0] for _ in range(n_sources)]  # [n_seqs, n_tokens, n_loss_tokens] per source
    for q in seqs:
        c = by_source[q["source"]]
        c[0], c[1], c[2] = c[0] + 1, c[1] + len(q["z"]), c[2] + int(q["loss_mask"].sum())
    tensors = pack_shard(seqs, store_features)
    meta = {"split": split, "shard": k, "n_seqs": len(seqs), "n_tokens": int(tensors["z_ids"].numel()),
            "n_loss_tokens": int(tensors["loss_mask"].sum()), "config_hash": config_hash, "by_source": by_source}
    save_tensors(out_dir / shard_file(split, k), tensors, META_KEY, meta)
    return meta


def existing_manifest(folder: Path, refusal: str, flag: str = "folder") -> dict | None:
    """The manifest in `folder` (named `flag` in the errors), None for an empty or missing folder; a folder holding
    anything else is refused with `refusal`."""
    if not folder.exists() or not any(folder.iterdir()):
        return None
    man = read_manifest(folder, required=False, hint=f"delete it or choose another {flag}")
    if man is None:
        raise UserError(refusal)
    return man


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


def folder_manifest(out_dir: Path, *, config: dict, config_hash: str, seed: int, sources: list[dict], models: dict,
                    planned: dict) -> dict:
    """The manifest as the folder stands: every finished shard file, in index order, and the
    counts per split and per source. `config` is the run's config as stored (DatagenConfig.stored()),
    `sources` its `sources` entries; generate.build_manifest fills these in from a DatagenConfig."""
    srcs = [{**src, "splits": {s: dict.fromkeys(COUNTS, 0) for s in SPLITS}} for src in sources]
    splits, complete = {}, True
    for s in SPLITS:
        entry = {**dict.fromkeys(COUNTS, 0), "shards": []}
        for k in range(planned[s]["n_shards"]):
            f = shard_file(s, k)
            if not (out_dir / f).is_file():
                complete = False
                continue
            m = tensors_meta(out_dir / f, META_KEY)
            entry["shards"].append({"file": f, "n_seqs": m["n_seqs"], "n_tokens": m["n_tokens"],
                                    "n_loss_tokens": m["n_loss_tokens"]})
            for a, b in zip(COUNTS, ("n_seqs", "n_tokens", "n_loss_tokens")):
                entry[a] += m[b]
            for src, counts in zip(srcs, m.get("by_source", [])):
                for a, c in zip(COUNTS, counts):
                    src["splits"][s][a] += c
        splits[s] = entry
    return {"format": FORMAT, "config": config, "config_hash": config_hash, "seed": seed,
            "models": models, "splits": splits, "sources": srcs, "planned": planned, "complete": complete}


def write_manifest(out_dir: Path, manifest: dict):
    write_json(out_dir / "manifest.json", manifest)
