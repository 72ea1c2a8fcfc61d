"""What a datagen folder holds, per split and prompt source: responses, tokens, loss positions,
response lengths, and the acceptance statistics the heads learn from.

    python eval/datagen_stats.py --data data/datagen/mix [--goal 300000] [--out FILE.md]

Columns: responses; response tokens; loss positions (loss_mask = 1: Z came from the draft);
mean response length and the share cut at max_new_tokens (the rest ended with EOS); mean
P = min(1, p/q) over loss positions and the share with P = 1 (the token is surely accepted);
mean 1 - TV(p, q) (the expected acceptance); mean log q(Y) of the draft's own candidate; and two
AUCs (accepted = P >= 0.99, as in training.auc): the draft's own log q(Y), the training-free
predictor a head must beat, and 1 - TV(p, q), which knows the target's p (no head sees p): a
reference for how much a predictor of acceptance can separate on this data. Reads only the small
tensors (no features), so it runs on the committed token data.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from adaptive_spec.datagen.generate import SPLITS, load_shard
from adaptive_spec.errors import run_main
from adaptive_spec.runs import atomic_write, project_path, read_manifest
from adaptive_spec.tables import fmt, md_table
from adaptive_spec.training.metrics import auc

HEADER = ["split", "source", "responses", "tokens", "loss positions", "mean length", "cut at cap", "mean P",
          "P = 1", "mean 1 - TV", "mean log q(Y)", "AUC log q(Y)", "AUC 1 - TV (knows p)"]


class _Acc:
    def __init__(self):
        self.n = self.tok = self.loss = self.cut = 0
        self.cols = defaultdict(list)  # per loss position: the means and the AUCs come from these

    def add(self, sh: dict, rows: list[int], cap: int):
        ro = sh["resp_offsets"].tolist()
        for r in rows:
            a, b = ro[r], ro[r + 1]
            m = sh["loss_mask"][a:b].bool()
            self.n, self.tok, self.loss = self.n + 1, self.tok + (b - a), self.loss + int(m.sum())
            self.cut += int(b - a >= cap)
            self.cols["P"].append(sh["accept_prob"][a:b][m].double())
            self.cols["tv"].append(sh["expected_accept"][a:b][m].double())
            self.cols["logq"].append(sh["draft_stats"][a:b, 0][m].double())

    def auc(self, key: str) -> float:
        return auc(torch.cat(self.cols[key]), torch.cat(self.cols["P"])) if self.loss else float("nan")

    def row(self, split: str, source: str) -> list[str]:
        col = {k: torch.cat(v) for k, v in self.cols.items()}
        per = (lambda x: float(x.mean())) if self.loss else (lambda x: float("nan"))
        return [split, source, str(self.n), str(self.tok), str(self.loss), fmt(self.tok / max(self.n, 1), ".1f"),
                fmt(self.cut / max(self.n, 1), ".1%"), fmt(per(col["P"]), ".3f"), fmt(per((col["P"] >= 1.0).double()), ".1%"),
                fmt(per(col["tv"]), ".3f"), fmt(per(col["logq"]), ".2f"), fmt(self.auc("logq"), ".3f"), fmt(self.auc("tv"), ".3f")]


def stats(data: Path) -> tuple[dict, list[list[str]]]:
    man = read_manifest(data, hint="point --data at a folder written by `adaptive-spec datagen`")
    names = [s["name"] for s in man.get("sources") or []] or [man["config"].get("dataset", "all")]
    cap = int(man["config"]["max_new_tokens"])
    rows = []
    for split in SPLITS:
        per_src, total = defaultdict(_Acc), _Acc()
        for entry in man["splits"].get(split, {}).get("shards", []):
            sh = load_shard(data / entry["file"])
            sid = sh.get("source_ids", torch.zeros(len(sh["prompt_lens"]), dtype=torch.int32)).tolist()
            for k in sorted(set(sid)):
                per_src[names[k]].add(sh, [r for r, s in enumerate(sid) if s == k], cap)
            total.add(sh, list(range(len(sid))), cap)
        if total.n:
            rows += [per_src[n].row(split, n) for n in names if n in per_src]
            rows.append(total.row(split, "**all**"))
    return man, rows


def _main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python eval/datagen_stats.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="datagen folder (manifest.json + shards)")
    ap.add_argument("--goal", type=int, default=0, help="training loss positions wanted (e.g. 300000): prints progress")
    ap.add_argument("--out", default="", help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    data = project_path(a.data)
    man, rows = stats(data)
    planned = man.get("planned", {})
    head = [f"# Datagen statistics: {a.data}", "",
            f"config_hash {man['config_hash']}, draft {man['models']['draft']['name']} (draft_quant "
            f"{man['config'].get('draft_quant')}, vocab {man['config'].get('draft_vocab') or 'full'}), target "
            f"{man['models']['target']['name']}, T = {man['config']['temperature']}, top-k {man['config']['top_k']}, "
            f"max_new_tokens {man['config']['max_new_tokens']}, mix_ratio {man['config']['mix_ratio']}; complete: "
            f"{man['complete']}",
            "shards done / planned: " + ", ".join(f"{s} {len(man['splits'][s]['shards'])}/{planned.get(s, {}).get('n_shards', '?')}"
                                                  for s in SPLITS if planned.get(s, {}).get("n_shards")), ""]
    if a.goal:
        have = man["splits"]["train"]["n_loss_tokens"]
        every = man["splits"]["train"]["n_tokens"]  # with target-prefix states every Y_i trains (features.PREFIXES)
        head += [f"train loss positions: {have} of the goal {a.goal} ({have / a.goal:.1%}) with token mixing; "
                 f"{every} ({every / a.goal:.1%}) with states on the target prefix "
                 "(`adaptive-spec datagen-features --prefix target`: every response token trains)", ""]
    text = "\n".join(head + [md_table(HEADER, rows)]) + "\n"
    print(text)
    if a.out:
        out = project_path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
