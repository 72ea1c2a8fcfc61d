"""Draft features for a datagen run that stored none: `adaptive-spec datagen-features`.

A run's token data (X, Y, Z, P, draft statistics) is ~5 KB a response, the draft's hidden states
~230 KB; the token data is the expensive part (a target pass per token) and is worth keeping across
machines, so a run can store only it (`store_features: false`, as configs/datagen/mix.yaml does).
This command derives the features with one pass of the frozen draft per response, into a complete
datagen folder that training, `autotune` and `eval/score_heads.py ablate` read as any other:

    adaptive-spec datagen-features --data data/datagen/mix --out runs/datagen/mix
    adaptive-spec datagen-features --data data/datagen/mix --out runs/datagen/mix-target --prefix target

The draft loads in the configuration the data was made with (its fingerprint must match): heads are
trained on the hidden states of the draft they serve. The pass runs over (prompt, Z) uncached, where
datagen reused the prompt's KV cache: the same states up to rounding (tested). `--prefix target`
computes the states on the target's own response (features.PREFIXES) in one pass over (x, X, Y) whose
mask shows Y_i only the prompt and X_<i, at X_i's position: N more tokens a response, and the inputs
the decoder gives a head. Each output shard is written atomically and is the unit of resume."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backends.models import load_model
from ..backends.cpu.quant import densify_quantized
from ..backends.runner import model_fingerprint, resolve_device
from ..errors import UserError, get_logger
from ..heads.features import CONTEXT_KEY, PREFIXES
from ..runs import fill_shards, project_path, read_manifest, save_tensors, tensors_meta
from .config import WORK_ORDER, DatagenConfig
from .generate import build_manifest
from .shards import FORMAT, META_KEY, existing_manifest, load_shard, write_manifest

log = get_logger(__name__)


def load_draft(manifest: dict, dtype: str, device):
    """The draft in the configuration the data was made with, checked against its fingerprint."""
    cfg, want = manifest["config"], manifest["models"]["draft"]
    draft, _ = load_model(cfg.get("draft", "default"), "draft", dtype, device, quant=cfg.get("draft_quant", "none"),
                          draft_vocab=cfg.get("draft_vocab") or None, fp16=False)
    densify_quantized(draft)  # every pass here is a many-row prefill: dense GEMM beats the int8 kernel
    if draft.config.hidden_size != want["hidden_size"]:
        raise UserError(f"draft {cfg.get('draft')!r} has hidden size {draft.config.hidden_size} but the data was made "
                        f"with hidden size {want['hidden_size']}; the data belongs to another draft model")
    fp = model_fingerprint(draft)
    if want.get("fingerprint") and fp != want["fingerprint"]:
        raise UserError(f"draft {cfg.get('draft')!r} (draft_quant={cfg.get('draft_quant')}) has weights fingerprint "
                        f"{fp}, the data was made with {want['fingerprint']}; features must come from the draft "
                        "that generated the data (rebuild it with `adaptive-spec fetch-models --force`, or "
                        "regenerate the data)")
    return draft


def _sequences(shard: dict[str, torch.Tensor]):
    """(input start, prompt length, response start, response end) of each sequence with a response, checked."""
    io, ro, pl = shard["input_offsets"].tolist(), shard["resp_offsets"].tolist(), shard["prompt_lens"].tolist()
    for s in range(len(pl)):
        n = ro[s + 1] - ro[s]
        if io[s + 1] - io[s] != pl[s] + n:
            raise UserError(f"sequence {s} has {io[s + 1] - io[s]} input tokens but prompt {pl[s]} + response "
                            f"{n}; the shard is corrupt: regenerate it (delete it and rerun datagen)")
        if n:
            yield io[s], pl[s], ro[s], ro[s + 1]


@torch.inference_mode()
def response_features(draft, shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """[T, H] bf16: the draft's final hidden state at every response position of a shard, i.e.
    at the position whose input token is Z_i, over the sequence (prompt, Z) -- what datagen's
    `features` tensor holds."""
    dev = draft.get_input_embeddings().weight.device
    out = []
    for start, L, a, b in _sequences(shard):
        ids = shard["input_ids"][start: start + L + b - a].long().to(dev)[None]
        h = draft.base_model(input_ids=ids).last_hidden_state[0, L:]
        out.append(h.to(torch.bfloat16).cpu())
    H = draft.config.hidden_size
    return torch.cat(out) if out else torch.empty(0, H, dtype=torch.bfloat16)


@torch.inference_mode()
def target_prefix_features(draft, shard: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, H], [T, H]) bf16: e(x, X_<i, Y_i) and e(x, X_<i) at every response position i of a
    shard (features.PREFIXES "target"). One pass per response over (x, X_1..X_n, Y_1..Y_n): the
    prompt and X attend causally; Y_i sits at X_i's position and attends the prompt, X_<i and
    itself, so it sees exactly the prefix p_i and q_i were computed on."""
    dev = draft.get_input_embeddings().weight.device
    dtype = draft.dtype
    tok, ctx = [], []
    for start, L, a, b in _sequences(shard):
        n = b - a
        prompt = shard["input_ids"][start: start + L].long()
        ids = torch.cat([prompt, shard["x_ids"][a:b].long(), shard["y_ids"][a:b].long()])
        m = L + n
        attend = torch.zeros(m + n, m + n, dtype=torch.bool)
        attend[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
        i = torch.arange(n)
        attend[m:, :L] = True
        attend[m:, L:m] = i[None, :] < i[:, None]  # Y_i sees X_j for j < i
        attend[m + i, m + i] = True
        mask = torch.zeros(1, 1, m + n, m + n, dtype=dtype).masked_fill_(~attend, torch.finfo(dtype).min)
        pos = torch.cat([torch.arange(m), L + i])
        h = draft.base_model(input_ids=ids.to(dev)[None], attention_mask=mask.to(dev),
                             position_ids=pos.to(dev)[None]).last_hidden_state[0]
        tok.append(h[m:].to(torch.bfloat16).cpu())
        ctx.append(h[L - 1: m - 1].to(torch.bfloat16).cpu())  # after x, X_<i: what produced q_i
    H = draft.config.hidden_size
    empty = torch.empty(0, H, dtype=torch.bfloat16)
    return (torch.cat(tok) if tok else empty), (torch.cat(ctx) if ctx else empty)


def _out_manifest(src_man: dict, src: Path, dst: Path, extra: dict) -> dict:
    """The source's manifest restricted to the shards present in dst, counts rebuilt from them."""
    man = build_manifest(dst, DatagenConfig.from_stored(src_man["config"]), src_man["models"], src_man["planned"])
    man["complete"] = man["complete"] and bool(src_man.get("complete"))
    man["features"] = {"from": str(src), **extra}
    return man


def run(data: str, out: str, dtype: str = "auto", device: str = "auto", threads: int = 0, progress: bool = True,
        prefix: str = "mixed") -> dict:
    if prefix not in PREFIXES:
        raise UserError(f"--prefix must be one of {', '.join(PREFIXES)}, got {prefix!r}")

    src, dst = project_path(data), project_path(out)
    if src.resolve() == dst.resolve():
        raise UserError(f"--out {out} is the --data folder; write the features to another folder")
    src_man = read_manifest(src, hint="point --data at a folder written by `adaptive-spec datagen`")
    if src_man.get("format") != FORMAT:
        raise UserError(f"{src} holds no datagen run (format {src_man.get('format')!r})")
    old = existing_manifest(dst, f"--out {dst} is not empty and holds no datagen run; choose another folder")
    if old is not None and old.get("config_hash") != src_man["config_hash"]:
        raise UserError(f"--out {dst} holds features of another datagen run (config_hash {old.get('config_hash')}, "
                        f"--data has {src_man['config_hash']}); choose another folder or delete it")
    old_prefix = ((old or {}).get("features") or {}).get("prefix", "mixed")
    if old is not None and old_prefix != prefix:
        raise UserError(f"--out {dst} holds states on the {old_prefix} prefix, and --prefix is {prefix}; choose "
                        f"another folder (e.g. {dst}-{prefix}) or rerun with --prefix {old_prefix}")
    todo = [sh for s in WORK_ORDER if s in src_man["splits"] for sh in src_man["splits"][s]["shards"]
            if not (dst / sh["file"]).is_file()]
    if threads > 0:
        torch.set_num_threads(threads)
    extra = {"dtype": dtype, "prefix": prefix}
    if todo:
        return _derive(src, dst, src_man, todo, extra, device, progress)
    man = _out_manifest(src_man, src, dst, extra)
    write_manifest(dst, man)
    log.info(f"datagen-features: {dst} is up to date ({sum(len(v['shards']) for v in man['splits'].values())} shards)")
    return man


def _derive(src: Path, dst: Path, src_man: dict, todo: list[dict], extra: dict, device: str, progress: bool) -> dict:
    """Write the shards `todo` of src into dst with the draft's states, the manifest first, after each and at the
    end; `extra` (the manifest's "features") gains the draft's cpu_path. Returns the final manifest."""
    draft = load_draft(src_man, extra["dtype"], resolve_device(device))
    extra["cpu_path"] = getattr(draft, "cpu_path", {})
    n_tok = sum(sh["n_tokens"] for sh in todo)
    log.info(f"datagen-features: {src} -> {dst}: {len(todo)} shard(s), {n_tok} response tokens to do")
    t0, done = time.perf_counter(), 0
    with tqdm(total=n_tok, unit="tok", disable=not progress, dynamic_ncols=True, mininterval=1.0,
              desc="datagen-features") as bar:
        for sh in fill_shards(dst, todo, lambda: _out_manifest(src_man, src, dst, extra), first=True):
            tensors = load_shard(src / sh["file"])
            if extra["prefix"] == "target":
                tensors["features"], tensors[CONTEXT_KEY] = target_prefix_features(draft, tensors)
            else:
                tensors["features"] = response_features(draft, tensors)
            save_tensors(dst / sh["file"], tensors, META_KEY, tensors_meta(src / sh["file"], META_KEY))
            done += sh["n_tokens"]
            bar.update(sh["n_tokens"])
            bar.set_postfix_str(f"{done / (time.perf_counter() - t0):.0f} tok/s")
    log.info(f"datagen-features: done: {dst} ({done} tokens in {time.perf_counter() - t0:.0f} s)")
    return read_manifest(dst)
