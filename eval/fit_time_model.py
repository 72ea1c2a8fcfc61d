"""Eq. 3.1 against the extended time model on a sweep, side by side, and with --costs the table model (adaptive_spec/decoding/auto/timemodel.py).

    python eval/fit_time_model.py eval/results/sweep_cpu_full [--costs ~/.cache/adaptive_spec/costs/KEY.json]

Per dataset and pooled: each model's times, R² of decode time on the speculative rows, and the
relative error of predicted vs measured decode throughput per configuration (mean and max), then
which model predicts better. With --costs (a file that `measure_costs` cached on the sweep's
machine and configuration), both models are also scored with the measured times, nothing fitted:
that is what `--threshold auto` relies on. Writes nothing; the table goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.runs import read_jsonl
from adaptive_spec.decoding.auto import Costs, comparison_table, costs_from_json


def load_costs(path: str) -> Costs:
    try:
        return costs_from_json(json.loads(Path(path).expanduser().read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--costs {path} is not a costs file written by measure_costs ({type(e).__name__}: {e})") from None


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="a sweep's out_dir (holds results.jsonl)")
    ap.add_argument("--costs", default=None, help="measured forward times (JSON from the costs cache) to score too")
    args = ap.parse_args(argv)
    rows = read_jsonl(Path(args.sweep_dir) / "results.jsonl")
    if not rows:
        raise UserError(f"{args.sweep_dir} has no results.jsonl rows; pass a sweep's out_dir")
    print(f"# Time models on {args.sweep_dir} ({len(rows)} rows)\n")
    print(comparison_table(rows, load_costs(args.costs) if args.costs else None))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(_main, sys.argv[1:], "nothing was written"))
