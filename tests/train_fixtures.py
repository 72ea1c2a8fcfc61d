"""Synthetic datasets in the datagen format (adaptive_spec.datagen.v1) for the trainer's tests.

With features: random hidden states h and targets P = min(1, 1.25 * sigmoid(w.h + b)), so P
depends learnably on h (many exact 1s, like min(1, p/q)) and a trained head's KL drops.
Without features: token ids for a real tiny draft model, which the trainer runs itself.
draft_stats are those of a random draft distribution q_i and Y_i ~ q_i (features.draft_stats),
drawn from their own generator so the other tensors do not depend on them; `stats_weight` > 0
adds that multiple of the standardized log q(Y_i) to P's logit, so the stats carry signal the
hidden state does not. `stats=False` is a dataset of a datagen that predates draft_stats;
`sources` names a prompt mix (manifest "sources", shard tensor source_ids per sequence).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from adaptive_spec.heads.features import draft_stats


def make_dataset(root: Path, hidden_size: int = 16, seqs: dict[str, int] | None = None, features: bool = True,
                 draft_name: str = "tiny-draft", vocab_size: int = 32, seed: int = 0, seqs_per_shard: int = 8,
                 stats: bool = True, stats_weight: float = 0.0, sources: list[str] | None = None,
                 clean: bool = False) -> Path:
    root = Path(root)
    seqs = seqs or {"train": 24, "dev": 8, "test": 4}
    g = torch.Generator().manual_seed(seed)
    gs = torch.Generator().manual_seed(seed + 1000)
    w = torch.randn(hidden_size, generator=g) * 2 / hidden_size ** 0.5
    manifest = {"format": "adaptive_spec.datagen.v1", "config": {"synthetic": True, "temperature": 1.0, "top_k": 0,
                                                                 "top_p": 1.0},
                "config_hash": f"synthetic-{seed}", "seed": seed, "complete": True, "splits": {},
                "models": {"draft": {"name": draft_name, "hidden_size": hidden_size, "vocab_size": vocab_size,
                                     "fingerprint": "fp-draft"},
                           "target": {"name": "tiny-target", "hidden_size": 24, "vocab_size": vocab_size,
                                      "fingerprint": "fp-target"}}}
    if sources:
        manifest["sources"] = [{"name": s, "n": -1, "field": ""} for s in sources]
    for split, n in seqs.items():
        shards, tot = [], {"n_prompts": n, "n_tokens": 0, "n_loss_tokens": 0}
        for k, start in enumerate(range(0, n, seqs_per_shard)):
            ns = min(seqs_per_shard, n - start)
            plen = torch.randint(2, 6, (ns,), generator=g)
            rlen = torch.randint(5, 20, (ns,), generator=g)
            T = int(rlen.sum())
            ids = torch.randint(4, vocab_size, (int((plen + rlen).sum()),), generator=g)
            h = torch.randn(T, hidden_size, generator=g)
            q = (2 * torch.randn(T, vocab_size, generator=gs)).softmax(-1)
            st = draft_stats(q, torch.multinomial(q, 1, generator=gs)[:, 0])
            z = h @ w + 0.5
            if stats_weight:
                z = z + stats_weight * (st[:, 0] - st[:, 0].mean()) / st[:, 0].std()
            p = (1.25 * torch.sigmoid(z)).clamp(max=1.0)
            mask = (torch.rand(T, generator=g) > 0.15).to(torch.uint8)  # 15% target tokens, as in the paper
            t = {"input_ids": ids.int(),
                 "input_offsets": torch.cat([torch.zeros(1), (plen + rlen).cumsum(0)]).long(),
                 "prompt_lens": plen.int(), "resp_offsets": torch.cat([torch.zeros(1), rlen.cumsum(0)]).long(),
                 "x_ids": torch.randint(4, vocab_size, (T,), generator=g).int(),
                 "y_ids": torch.randint(4, vocab_size, (T,), generator=g).int(),
                 "z_ids": torch.randint(4, vocab_size, (T,), generator=g).int(),
                 "loss_mask": mask, "accept_prob": p.float(), "expected_accept": (0.9 * p).float()}
            if features:
                t["features"] = h.to(torch.bfloat16)
            if features and clean:  # target-prefix shards (features.PREFIXES): context states of their own
                t["context_features"] = torch.randn(T, hidden_size, generator=gs).to(torch.bfloat16)
            if stats:
                t["draft_stats"] = st
            if sources:
                t["source_ids"] = torch.randint(0, len(sources), (ns,), generator=gs).int()
            f = f"{split}/shard-{k:05d}.safetensors"
            (root / split).mkdir(parents=True, exist_ok=True)
            save_file(t, str(root / f))
            shards.append({"file": f, "n_seqs": ns, "n_tokens": T, "n_loss_tokens": int(mask.sum())})
            tot["n_tokens"] += T
            tot["n_loss_tokens"] += int(mask.sum())
        manifest["splits"][split] = {**tot, "shards": shards}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root
