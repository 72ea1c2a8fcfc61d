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

Reference answers (build_references) add text the target did not write: the named sets' (prompt, answer)
pairs (prompts.reference_pairs) whose prompts the datagen folder does not hold, in a folder of their own with
the same layout, training sequences only. The dev sequences stay the target's own responses.

A shard is written atomically and is the unit of resume: rerunning the same call skips the shards that exist
(the manifest is rebuilt from the folder after each one), and a folder made with other settings is refused.
The target runs once per sequence, in bf16 on a CPU with bf16 kernels (backends/cpu/machine.py), else in fp32.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from ..errors import UserError, get_logger
from ..runs import check_settings, fill_shards, read_manifest, save_tensors, tensors_meta, write_json

log = get_logger(__name__)

FORMAT = "adaptive_spec.drafter_data.v1"
SPLITS = ("train", "dev")
KEY_TOKENS = 32  # a prompt is known by its last KEY_TOKENS ids: enough to tell requests apart, cheap to hold
_META = "adaptive_spec.drafter_data"


def plan(source: str | Path, max_seqs: dict) -> dict:
    """{split: [(source shard file, sequences to take)]}: the source's shards in order, up to max_seqs[split]
    sequences (0: all) per split."""
    man = read_manifest(source, hint="point `data` at a folder written by `adaptive-spec datagen`")
    out = {}
    for split in SPLITS:
        most, taken, todo = max_seqs.get(split, 0), 0, []
        for sh in (man.get("splits", {}).get(split) or {}).get("shards", []):
            if most and taken >= most:
                break
            n = min(sh["n_seqs"], most - taken) if most else sh["n_seqs"]
            todo.append((sh["file"], n))
            taken += n
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
    save_tensors(path, t, _META, {"n_seqs": len(seqs), "n_tokens": sum(lens)})


def shard_name(split: str, k: int) -> str:
    return f"{split}/hidden-{k:05d}.safetensors"


def folder_manifest(out_dir: Path, settings: dict, target: dict, n_shards: dict[str, int]) -> dict:
    splits, complete = {}, True
    for split, n in n_shards.items():
        entry = {"shards": [], "n_seqs": 0, "n_tokens": 0}
        for k in range(n):
            f = out_dir / shard_name(split, k)
            if not f.is_file():
                complete = False
                continue
            meta = tensors_meta(f, _META)
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
    old = _check_folder(out_dir, settings)
    if old is not None and old.get("complete"):
        return old
    todo = plan(source, max_seqs)
    jobs = [(split, k, n, lambda f=f, n=n: sequences(load_file(str(source / f)), n, prompt_tail, max_len))
            for split, shards in todo.items() for k, (f, n) in enumerate(shards)]
    return _fill(out_dir, jobs, load_target, settings, old, progress, stop_after)


def prompt_keys(source: str | Path) -> set[tuple[int, ...]]:
    """The last KEY_TOKENS ids of every prompt a datagen folder holds (all splits): what a reference answer's
    prompt is matched against, so that no dev prompt and no prompt already there comes back as a reference."""
    keys = set()
    man = read_manifest(source, hint="point `data` at a folder written by `adaptive-spec datagen`")
    for entry in (man.get("splits") or {}).values():
        for sh in (entry or {}).get("shards", []):
            t = load_file(str(Path(source) / sh["file"]))
            off, lens = t["input_offsets"].tolist(), t["prompt_lens"].tolist()
            keys.update(tuple(t["input_ids"][a: a + p][-KEY_TOKENS:].tolist()) for a, p in zip(off, lens))
    return keys


def reference_sequences(tok, references: dict[str, int], exclude: set, prompt_tail: int,
                        max_len: int) -> list[tuple[torch.Tensor, int]]:
    """(ids, response start) of the first n (prompt, reference answer) pairs of each named set (prompts.
    reference_pairs) whose prompt is neither in `exclude` nor taken already, tokenized as one chat exchange and
    cut as datagen's sequences are."""
    from ..prompts import answer_ids, encode_prompt, reference_pairs

    out, seen = [], set(exclude)
    for name, n in references.items():
        got = 0
        for prompt, answer in reference_pairs(name):
            if got == n:
                break
            p = encode_prompt(tok, prompt, chat=True)
            if tuple(p[-KEY_TOKENS:]) in seen:
                continue
            seen.add(tuple(p[-KEY_TOKENS:]))
            keep = min(len(p), prompt_tail)
            out.append((torch.tensor(p[len(p) - keep:] + answer_ids(tok, prompt, answer), dtype=torch.long)[:max_len],
                        keep))
            got += 1
        if got < n:
            raise UserError(f"references: {name!r} has {got} usable (prompt, answer) pairs outside the datagen "
                            f"data, fewer than the {n} asked; ask for at most {got}")
    return out


def build_references(source: str | Path, out_dir: str | Path, load_target, load_tokenizer, settings: dict,
                     references: dict[str, int], prompt_tail: int = 128, max_len: int = 512, per_shard: int = 64,
                     progress: bool = True, stop_after: int = 0) -> dict:
    """The target's states along reference answers (reference_sequences) into out_dir, as training shards of
    per_shard sequences each; same contract as `build` (resumable, settings checked, a manifest)."""
    out_dir = Path(out_dir)
    settings = {**settings, "references": dict(references), "excluding": str(source), "prompt_tail": prompt_tail,
                "max_len": max_len, "per_shard": per_shard}
    old = _check_folder(out_dir, settings)
    if old is not None and old.get("complete"):
        return old
    seqs = reference_sequences(load_tokenizer(), references, prompt_keys(source), prompt_tail, max_len)
    chunks = [seqs[i: i + per_shard] for i in range(0, len(seqs), per_shard)]
    jobs = [("train", k, len(c), lambda c=c: c) for k, c in enumerate(chunks)]
    return _fill(out_dir, jobs, load_target, settings, old, progress, stop_after)


def _check_folder(out_dir: Path, settings: dict) -> dict | None:
    old = read_manifest(out_dir, required=False)
    if old is not None:
        check_settings(out_dir, old.get("settings", {}), settings, kind="hidden-state set",
                       fix="rerun with the settings it was made with, or choose another folder")
    return old


def _fill(out_dir: Path, jobs: list, load_target, settings: dict, old: dict | None, progress: bool,
          stop_after: int) -> dict:
    """Write each job's shard (split, k, n sequences, a function giving them) that out_dir lacks."""
    n_shards = {s: sum(1 for j in jobs if j[0] == s) for s in SPLITS}
    missing = [j for j in jobs if not (out_dir / shard_name(j[0], j[1])).is_file()]
    model, target = None, old["target"] if old is not None else None
    shards = fill_shards(out_dir, missing, lambda: folder_manifest(out_dir, settings, target, n_shards), stop_after)
    with tqdm(total=sum(j[2] for j in missing), unit="seq", disable=not progress, desc="target states") as bar:
        for split, k, _, get in shards:
            if model is None:
                model, target = load_target()
                write_json(out_dir / "manifest.json", folder_manifest(out_dir, settings, target, n_shards))
            seqs = get()
            hidden = []
            for ids, _ in seqs:
                hidden.append(target_states(model, ids))
                bar.update(1)
            write_shard(out_dir / shard_name(split, k), seqs, hidden)
    return read_manifest(out_dir)


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
