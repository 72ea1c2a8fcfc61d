"""Diagnostic: how well does each predictor of acceptance separate accepted from rejected draft
tokens on a datagen split? The ceiling on what any stop policy can gain is set here.

For every draft token Y_i of the split (loss positions, except a response's first, whose
context state is the prompt's and is not stored) the target is P_i = min(1, p(Y_i)/q(Y_i)).
Predictors:
  constant        the split's mean P (the no-information baseline)
  q(y), H(q)      the draft's own confidence in Y_i and its entropy at step i (the training-free
                  rules): datagen's stored draft_stats, i.e. q_i itself; for datasets made before
                  datagen stored them, the draft's LM head applied to the stored state e_{i-1}
                  (on mixed-prefix states that is q(.|x, Z_<i), not q_i: a weaker stand-in)
  <head>          each acceptance head on its own input (token: e_i, context: e_{i-1}; with
                  inputs=hidden+stats also the stored draft_stats of Y_i)
  logistic(...)   logistic regressions on combinations, fitted and scored by 2-fold cross
                  validation inside the split (so they are honest about what the split allows)
On target-prefix states (`datagen-features --prefix target`) every position is scored, a
context head reading context_features. Scores: KL(P || p_hat) per token (Bernoulli, what training minimises), and AUC: the chance that
a token with P_i >= 0.99 is ranked above one with P_i < 0.99 (not P_i = 1 exactly: where p and
q nearly coincide, p/q lands a hair below 1 in floating point, and such a token is as good as
accepted).

    python eval/probe_heads.py --data runs/datagen/gsm8k --split dev --heads 'checkpoints/*'

Writes <out>/results.json (one row per predictor), <out>/table.md and <out>/run.json (what the table
says beside the rows: the split's mean P and share accepted, the sampling, evaluation/paired.run_header).
`--report-only --out DIR` rewrites DIR/table.md from those alone: no model, no data, no torch.
"""
from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive_spec.evaluation.paired import run_header

if TYPE_CHECKING:  # torch, the models and the heads are imported where a probe runs: --report-only needs none
    import torch

    from adaptive_spec.decoding.sampling import SamplingParams


def load_split(root: Path, manifest: dict, split: str, lm_head: torch.Tensor, params: SamplingParams,
               chunk: int = 512):
    import torch

    from adaptive_spec.decoding.sampling import process_logits
    from adaptive_spec.heads.features import CONTEXT_KEY, response_starts
    from adaptive_spec.training.data import mmap_tensor, read_small

    shards = ((manifest.get("splits") or {}).get(split) or {}).get("shards") or []
    if not shards:
        raise SystemExit(f"error: {root} has no {split} shards; run datagen first or pick another --split")
    out = {"P": [], "ctx": [], "tok": [], "log_qy": [], "H": [], "stats": []}
    for shard in shards:
        fn = root / shard["file"]
        g = read_small(fn, ["loss_mask", "resp_offsets", "y_ids", "accept_prob"], optional=("draft_stats",))
        if not bool(g["_has_features"]):
            raise SystemExit(f"error: {fn} has no stored features; regenerate with store_features=true")
        g["features"] = mmap_tensor(fn, "features")
        mask = g["loss_mask"].bool()
        if bool(g["_clean"]):  # target-prefix states: every position, each with its own context state
            pos = torch.arange(len(mask))
            ctx = mmap_tensor(fn, CONTEXT_KEY)[pos]
        else:
            pos = (mask & ~response_starts(g["resp_offsets"], len(mask))).nonzero().flatten()
            ctx = g["features"][pos - 1]
        y = g["y_ids"][pos].long()
        if "draft_stats" in g:  # q_i's own statistics, stored by datagen
            out["log_qy"].append(g["draft_stats"][pos, 0])
            out["H"].append(g["draft_stats"][pos, 1])
        else:
            for s in range(0, len(pos), chunk):  # [chunk, V] float32 at a time: V = 151,936 is large
                q = process_logits(ctx[s:s + chunk].to(lm_head.dtype) @ lm_head.T, params)
                out["log_qy"].append(q.gather(1, y[s:s + chunk, None])[:, 0].clamp_min(1e-8).log())
                out["H"].append(-(q * q.clamp_min(1e-30).log()).sum(-1))
        out["P"].append(g["accept_prob"][pos].float())
        out["ctx"].append(ctx)
        out["tok"].append(g["features"][pos])
        if "draft_stats" in g:  # datasets made before datagen stored them have none: no stats heads then
            out["stats"].append(g["draft_stats"][pos])
    return {k: torch.cat(v) if v else None for k, v in out.items()}


def cv_logistic(X: torch.Tensor, t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Out-of-fold logits of a logistic regression (soft targets), 2 folds."""
    import torch

    n = len(t)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    folds = [idx[: n // 2], idx[n // 2:]]
    pred = torch.empty(n)
    for a, b in (folds, folds[::-1]):
        mu, sd = X[a].mean(0), X[a].std(0) + 1e-6
        w = torch.zeros(X.shape[1], requires_grad=True)
        b0 = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([w, b0], max_iter=200)
        Xa = (X[a] - mu) / sd

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(Xa @ w + b0, t[a])
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            pred[b] = ((X[b] - mu) / sd) @ w + b0
    return pred


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="runs/datagen/gsm8k")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--heads", nargs="*", default=["checkpoints/*"], help="head folders or globs")
    ap.add_argument("--out", default="eval/results/probe_heads")
    ap.add_argument("--report-only", action="store_true",
                    help="score nothing: table.md from what <out> holds (results.json and run.json)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:  # from the folder alone: no model, no data
        header = run_header(out, report_only=True)
        # a folder kept before results.json sat beside its table holds the results in run.json
        results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() \
            else header["results"]
        (out / "table.md").write_text(report(results, header))
        return 0

    import torch

    from adaptive_spec.backends.models import load_model
    from adaptive_spec.decoding.sampling import SamplingParams
    from adaptive_spec.heads.head import AcceptanceHead, join_inputs, reads_stats
    from adaptive_spec.training.metrics import ACCEPTED, auc, binary_kl

    root = Path(args.data)
    manifest = json.loads((root / "manifest.json").read_text())
    c = manifest["config"]
    params = SamplingParams(c["temperature"], c["top_k"], c["top_p"])
    draft, _ = load_model(c["draft"], "draft", c["dtype"], "cpu", pack=False)
    lm_head = draft.get_output_embeddings().weight.detach()
    with torch.inference_mode():
        d = load_split(root, manifest, args.split, lm_head, params)
    del draft
    P = d["P"]
    # (name, score, is the score a logit of the acceptance probability, so that KL applies);
    # AUC needs only the order, which a logit keeps
    rows = [("constant (mean P)", torch.full_like(P, torch.logit(P.mean()).item()), True),
            ("draft confidence q(y)", d["log_qy"].exp(), False), ("draft entropy -H(q)", -d["H"], False)]
    logits = {}
    for pat in args.heads:
        for folder in sorted(glob.glob(pat)):
            if not (Path(folder) / "config.json").is_file():
                continue
            head = AcceptanceHead.from_pretrained(folder).float()
            stats = d["stats"] if reads_stats(head.inputs) else None
            if reads_stats(head.inputs) and stats is None:
                print(f"skipping {folder}: it reads draft_stats, which {root} does not store")
                continue
            with torch.inference_mode():
                z = head(join_inputs(d["ctx" if head.feature == "context" else "tok"], stats))
            logits[Path(folder).name] = z
            rows.append((f"head {Path(folder).name} ({head.feature}, {head.inputs})", z, True))
    qf = torch.stack([d["log_qy"], d["H"]], 1)
    rows.append(("logistic(q(y), H)", cv_logistic(qf, P), True))
    for name, z in logits.items():
        rows.append((f"logistic(q(y), H, {name})", cv_logistic(torch.cat([qf, z[:, None]], 1), P), True))
    if len(logits) > 1:
        allz = torch.cat([qf] + [z[:, None] for z in logits.values()], 1)
        rows.append(("logistic(q(y), H, all heads)", cv_logistic(allz, P), True))
    res = [{"predictor": n, "kl": binary_kl(P, z).mean().item() if is_logit else None, "auc": auc(z, P)}
           for n, z, is_logit in rows]
    out.mkdir(parents=True, exist_ok=True)
    results = {"data": args.data, "split": args.split, "n": len(P), "rows": res}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    header = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/probe_heads.py", "report": "table.md", "mean_p": P.mean().item(),
        "accepted_share": (P >= ACCEPTED).float().mean().item(), "accepted": ACCEPTED,
        "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p})
    md = report(results, header)
    (out / "table.md").write_text(md)
    print(md, end="")
    return 0


def report(results: dict, header: dict) -> str:
    """table.md: results.json's rows, with what run.json says of the split (its mean P and the share of
    tokens accepted, the sampling, the threshold P counts as accepted at). A folder annotated by hand
    (probe_heads_int8) also has a title, a note on how its data was made and the CPU line in run.json."""
    acc = header["accepted"]
    lines = [f"# {header['title']}", ""] if header.get("title") else []
    for key in ("note", "cpu"):
        if header.get(key):
            lines += [header[key], ""]
    lines += [f"{results['data']} {results['split']}: {results['n']} draft tokens, mean P {header['mean_p']:.3f}, "
              f"{header['accepted_share']:.1%} with P >= {acc}; sampling T={header['temperature']} "
              f"top-k {header['top_k']} top-p {header['top_p']}", "",
              f"| predictor | KL(P‖p̂) per token | AUC (P ≥ {acc} vs P < {acc}) |", "|---|---|---|"]
    lines += [f"| {r['predictor']} | {'–' if r['kl'] is None else format(r['kl'], '.4f')} | {r['auc']:.4f} |"
              for r in results["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
