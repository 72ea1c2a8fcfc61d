"""What a datagen folder holds, per split and prompt source: responses, tokens, loss positions,
response lengths, and the acceptance statistics the heads learn from.

    python eval/datagen_stats.py --data data/datagen/mix [--goal 300000] [--out FILE.md]
    python eval/datagen_stats.py --report-only --out eval/results/datagen_mix   # FILE.md again, from run.json

Columns: responses; response tokens; loss positions (loss_mask = 1: Z came from the draft);
mean response length and the share cut at max_new_tokens (the rest ended with EOS); mean
P = min(1, p/q) over loss positions and the share with P = 1 (the token is surely accepted);
mean 1 - TV(p, q) (the expected acceptance); mean log q(Y) of the draft's own candidate; and two
AUCs (accepted = P >= 0.99, as in training.auc): the draft's own log q(Y), the training-free
predictor a head must beat, and 1 - TV(p, q), which knows the target's p (no head sees p): a
reference for how much a predictor of acceptance can separate on this data. Reads only the small
tensors (no features), so it runs on the committed token data.

With --out the table is also written to FILE.md, and FILE.md's folder gets a run.json naming the data
folder and the goal (evaluation/paired.run_header): `--report-only --out FOLDER` writes that file again
from the data folder it names (its path relative to the project root), as tests/test_regenerate_reports.py
does for eval/results/datagen_mix.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

from adaptive_spec.datagen.shards import SPLITS, load_shard
from adaptive_spec.errors import run_main
from adaptive_spec.evaluation.paired import run_header
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


def report(man: dict, rows: list[list[str]], run: dict) -> str:
    """The statistics file: the manifest's settings and progress, the goal's (run["goal"], 0: none) and
    the table of `stats`, titled with the data folder as given (run["data"])."""
    planned = man.get("planned", {})
    head = [f"# Datagen statistics: {run['data']}", "",
            f"config_hash {man['config_hash']}, draft {man['models']['draft']['name']} (draft_quant "
            f"{man['config'].get('draft_quant')}, vocab {man['config'].get('draft_vocab') or 'full'}), target "
            f"{man['models']['target']['name']}, T = {man['config']['temperature']}, top-k {man['config']['top_k']}, "
            f"max_new_tokens {man['config']['max_new_tokens']}, mix_ratio {man['config']['mix_ratio']}; complete: "
            f"{man['complete']}",
            "shards done / planned: " + ", ".join(f"{s} {len(man['splits'][s]['shards'])}/{planned.get(s, {}).get('n_shards', '?')}"
                                                  for s in SPLITS if planned.get(s, {}).get("n_shards")), ""]
    goal = run.get("goal") or 0
    if goal:
        have = man["splits"]["train"]["n_loss_tokens"]
        every = man["splits"]["train"]["n_tokens"]  # with target-prefix states every Y_i trains (features.PREFIXES)
        head += [f"train loss positions: {have} of the goal {goal} ({have / goal:.1%}) with token mixing; "
                 f"{every} ({every / goal:.1%}) with states on the target prefix "
                 "(`adaptive-spec datagen-features --prefix target`: every response token trains)", ""]
    return "\n".join(head + [md_table(HEADER, rows)]) + "\n"


def _main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python eval/datagen_stats.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="datagen folder (manifest.json + shards); required unless --report-only "
                                   "(default there: the one run.json names)")
    ap.add_argument("--goal", type=int, default=None,
                    help="training loss positions wanted (e.g. 300000): prints progress (default: none; with "
                         "--report-only, run.json's)")
    ap.add_argument("--out", default="", help="also write the table to this markdown file (and run.json beside it); "
                                              "with --report-only, the folder whose run.json names the file")
    ap.add_argument("--report-only", action="store_true",
                    help="the file run.json in --out names, again, from the data folder it names")
    a = ap.parse_args(argv)
    if a.report_only:
        if not a.out:
            ap.error("--report-only needs --out (the folder with run.json)")
        folder = project_path(a.out)
        run = run_header(folder, report_only=True)
        run = {**run, "data": a.data or run["data"], "goal": run.get("goal") if a.goal is None else a.goal}
        man, rows = stats(project_path(run["data"]))
        atomic_write(folder / run.get("report", "report.md"), report(man, rows, run))
        return 0
    if not a.data:
        ap.error("--data is required (unless --report-only)")
    man, rows = stats(project_path(a.data))
    run = {"data": a.data, "goal": a.goal or 0}
    text = report(man, rows, run)
    print(text)
    if a.out:
        out = project_path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
        run_header(out.parent, report_only=False,
                   measure=lambda: {"script": "eval/datagen_stats.py", "report": out.name, **run})
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
