"""The batched KV decoder of datagen: target and draft stepped in lockstep over a batch of prompts,
with p_i, q_i, the sampled X_i, Y_i and the draft's features of every response position.

Not the decoder's runners: a runner decodes one sequence with its own cache; datagen decodes a batch of
prompts of different lengths at once, left-padded, through transformers' DynamicCache. Prompts are
prefilled one by one (a prefill is compute-bound: no pad rows), a row leaves the batch and both caches
when it samples EOS, and an int8 draft computes with a dense copy of its weights (every pass is batched)."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..backends.runner import model_kv, spread_kept_logits
from ..decoding.sampling import process_logits, sample
from ..heads.features import draft_stats


def generate_shard(draft, target, prompts, cfg, vocab, eos_ids, pad_id, gen, on_batch) -> list[dict]:
    """The sequences of one shard, in file order; batches hold prompts of similar length (less
    padding in the prefill). `cfg` is the run's DatagenConfig (config.py); this module reads
    its sampling(), batch_size, max_new_tokens, stop_at_eos, mix_ratio and store_features."""
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
    seqs: list = [None] * len(prompts)
    for b in range(0, len(order), cfg.batch_size):
        idx = order[b:b + cfg.batch_size]
        batch = generate_batch(draft, target, [prompts[j] for j in idx], cfg, vocab, eos_ids, pad_id, gen)
        for j, seq in zip(idx, batch):
            seqs[j] = seq
        on_batch(batch)
    return seqs


def mix_tokens(x: torch.Tensor, y: torch.Tensor, r: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Z = X with probability r, else Y (token mixing). Returns (z, loss_mask: 1 where Z came from Y)."""
    keep_x = torch.rand(x.shape, generator=gen, device=x.device) < r
    return torch.where(keep_x, x, y), (~keep_x).to(torch.uint8)


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _step(model, ids, mask, pos, cache, vocab: int, dev) -> torch.Tensor:
    d = _input_device(model)
    out = model(input_ids=ids.to(d), attention_mask=mask.to(d), position_ids=pos.to(d), **model_kv(model, cache),
                use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].float()
    kept = getattr(model, "kept_ids", None)
    if kept is not None:  # a reduced draft vocabulary: q = 0 outside the kept tokens, as in decoding
        logits = spread_kept_logits(logits, kept[kept < vocab], vocab)
    return logits[:, :vocab].to(dev)


# The only code here that reads DynamicCache's internals (its per-layer tensors, and dropping rows
# of the batch), written for transformers 5.24.0: where a newer version moves them, fix these two.


def _layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (keys, values) tensors [B, heads, L, dim] the cache holds (not copies)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _keep_rows(cache: DynamicCache, keep: torch.Tensor):
    cache.batch_select_indices(keep.to(cache.layers[0].keys.device))


def _prefill(model, prompts: list[list[int]], vocab: int, dev):
    """Each prompt's own forward, then its KV right-aligned into one left-padded batch cache:
    (logits at each prompt's last token [B, vocab], per layer (keys, values) [B, heads, L, dim]).

    Why not one forward padded to the batch's longest prompt: a prefill is compute-bound, and prompt
    lengths with a long tail make pad rows a large share of a padded batch's rows, even sorted by
    length, and a larger one the larger the batch (docs/datagen.md). (Prefilling runs of similar-length
    prompts together, with a little padding, is no faster: a forward's fixed cost, the
    weights read once, about equals the pad rows it adds.) The pad slots of the cache stay zero;
    the attention mask hides them, as it would a padded batch's pad rows."""
    caches, logits = [], []
    for s in prompts:
        c = DynamicCache(config=model.config)
        ids = torch.tensor([s], dtype=torch.long)
        logits.append(_step(model, ids, torch.ones_like(ids), torch.arange(len(s))[None], c, vocab, dev))
        caches.append(c)
    L = max(len(s) for s in prompts)
    layers = [_layer_kv(c) for c in caches]
    kv = []
    for i, (k0, v0) in enumerate(layers[0]):
        keys = k0.new_zeros(len(prompts), k0.shape[1], L, k0.shape[3])
        values = v0.new_zeros(len(prompts), v0.shape[1], L, v0.shape[3])
        for b, c in enumerate(layers):
            n = len(prompts[b])
            keys[b, :, L - n:] = c[i][0][0]
            values[b, :, L - n:] = c[i][1][0]
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
def generate_batch(draft, target, prompts: list[list[int]], cfg, vocab: int, eos_ids: list[int], pad_id: int,
                   gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Lockstep generation for one batch: per sequence x, y, z, loss_mask, accept_prob,
    expected_accept, draft_stats (and features) over its N response positions."""
    params = cfg.sampling()
    dev = gen.device
    B = len(prompts)
    L = max(len(s) for s in prompts)
    mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in prompts], dtype=torch.long)  # left padding
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: real tokens get 0, 1, 2, ... as unpadded
    prompt_mask = mask
    t_logits, t_kv = _prefill(target, prompts, vocab, dev)
    d_logits, d_kv = _prefill(draft, prompts, vocab, dev)
    tcache, dcache = _cache(target, t_kv), _cache(draft, d_kv)  # d_kv stays: the features pass
    del t_kv
    next_pos = pos[:, -1:] + 1
    eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
    lengths = torch.full((B,), cfg.max_new_tokens, dtype=torch.long)
    # The rows still generating (indices into the batch). A row that samples EOS leaves the batch
    # and both caches: decoding it on to max_new_tokens would pay a row in every later step, while
    # dropping rows from the caches is a copy of their KV, paid once per ending.
    act = torch.arange(B, device=dev)
    columns = []  # per position: x, y, accept_prob, expected_accept, draft_stats, each [B, ...]
    for i in range(cfg.max_new_tokens):
        sampled = _sample_position(t_logits, d_logits, params, gen)
        # the active rows' values into [B, ...]; the rows that ended hold pad_id (tokens) or 0
        columns.append([torch.full((B, *v.shape[1:]), fill, dtype=v.dtype, device=v.device).index_copy_(0, act, v)
                        for v, fill in zip(sampled, (pad_id, pad_id, 0, 0, 0))])
        x = sampled[0]
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
                    _keep_rows(c, keep)
        # feed X_i to both models
        mask = torch.cat([mask, torch.ones((len(act), 1), dtype=mask.dtype)], dim=1)
        t_logits = _step(target, x[:, None], mask, next_pos, tcache, vocab, dev)
        d_logits = _step(draft, x[:, None], mask, next_pos, dcache, vocab, dev)
        next_pos = next_pos + 1
    del tcache, dcache
    X, Y, P, E, D = (torch.stack(c, 1) for c in zip(*columns))
    Z, loss_mask = mix_tokens(X, Y, cfg.mix_ratio, gen)
    out = {"x": X.to(torch.int32), "y": Y.to(torch.int32), "z": Z.to(torch.int32), "loss_mask": loss_mask,
           "accept_prob": P.float(), "expected_accept": E.float(), "draft_stats": D.float()}
    if cfg.store_features:
        out["features"] = _draft_features(draft, _cache(draft, d_kv), pos[:, -1:] + 1, prompt_mask, Z)
    # per sequence, its first lengths[b] positions (tokens past its EOS dropped)
    return [{"prompt": torch.tensor(p, dtype=torch.int32),
             **{k: v[b, :int(lengths[b])].cpu().contiguous() for k, v in out.items()}} for b, p in enumerate(prompts)]


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
    return x, y, *acceptance(p, q, y)


def acceptance(p, q, y) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min(1, p(y)/q(y)), 1 - TV(p, q), draft_stats(q, y)) of candidates y drawn from q."""
    p_y = p.gather(-1, y[:, None])[:, 0]
    q_y = q.gather(-1, y[:, None])[:, 0]  # > 0: y was drawn from q
    return (p_y / q_y).clamp(max=1.0), torch.minimum(p, q).sum(-1), draft_stats(q, y)


def _draft_features(draft, prompt_cache, first_pos, prompt_mask, Z) -> torch.Tensor:
    """The draft's final hidden state (after the final norm) at the positions whose input tokens
    are Z_1..Z_n, i.e. over the sequence (prompt, Z). bf16 [B, n, H].

    `prompt_cache` holds the (padded) prompt from the prefill, so only Z is fed, which saves the
    prompt's share of this pass. Rows that ended early carry trailing pad tokens past their EOS;
    the pass is causal, so those do not touch earlier positions."""
    B, n = Z.shape
    mask = torch.cat([prompt_mask, torch.ones((B, n), dtype=prompt_mask.dtype)], dim=1)
    pos = first_pos + torch.arange(n)
    d = _input_device(draft)
    h = draft.base_model(input_ids=Z.to(d), attention_mask=mask.to(d), position_ids=pos.to(d),
                         **model_kv(draft.base_model, prompt_cache), use_cache=True).last_hidden_state
    return h.to(torch.bfloat16).cpu()
