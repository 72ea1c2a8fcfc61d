"""Training acceptance heads with Accelerate (SpecDec++ paper, section 4.4 and appendix D.1/D.3).

    accelerate launch train.py --config configs/train/default.yaml [key=value ...] [--resume]
    python train.py --config configs/train/sweep.yaml --sweep      # the D x w_rej grid, resumable

One example is one response position whose token came from the draft (loss_mask == 1): input = the
draft's final hidden state there (heads/features.py: which state, and the statistics), target =
min(1, p/q). Stored features are memory-mapped, not copied, so DDP processes share one copy in the
page cache; datasets without features get them from one pass of the frozen draft, cached on disk.
The loss is the paper's weighted BCE, reported every `eval_every` steps with Table 3's binary KL, AUC
and calibration; the head with the lowest dev loss is exported to <output_dir>/head. Checkpoints hold
everything that changes during training, so --resume reproduces an uninterrupted run exactly.
This module is the command line and the depth x w_rej grid; loop.py runs one training."""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
from pathlib import Path

from ..config import config_help, load_config
from ..errors import UserError, get_logger
from ..runs import atomic_write
from ..tables import md_table
from .loop import train
from .runfiles import RunFiles
from .settings import TrainConfig

log = get_logger(__name__)

SWEEP_DEPTHS = [0, 1, 2, 3, 4]  # paper section 5.1
SWEEP_W_REJS = [1.0, 3.0, 6.0, 12.0]


SWEEP_COLUMNS = ["depth", "w_rej", "best_step", "train_loss", "train_kl", "train_auc", "train_ece", "dev_loss", "dev_kl",
                 "dev_auc", "dev_ece"]


def sweep(cfg: TrainConfig) -> list[dict]:
    """Train every (depth, w_rej) head of the grid under <output_dir>/d{D}_wrej{w}; skip finished ones.

    Each head is its own run (its own Accelerator and checkpoints); the process group lives for
    the whole sweep and all heads share one feature cache. Writes sweep.csv and sweep.md
    (train/dev loss, KL, ECE: paper Table 3)."""
    from accelerate import PartialState  # optional: the [train] extra; loaded when the grid starts

    root = Path(cfg.output_dir)
    grid = [(d, w) for w in (cfg.w_rejs or SWEEP_W_REJS) for d in (cfg.depths or SWEEP_DEPTHS)]
    rows = []
    for d, w in grid:
        name = f"d{d}_wrej{w:g}"
        sub = cfg.model_copy(update=dict(depth=d, w_rej=float(w), output_dir=str(root / name),
                                         feature_cache=cfg.feature_cache or str(root / "features"),
                                         run_name=f"{cfg.run_name or root.name}-{name}"))
        PartialState().print(f"[sweep] head {name}")
        res = train(sub, resume=True, end_training=False)
        best = res.get("best") or {}
        rows.append({"depth": d, "w_rej": w, "best_step": res.get("best_step"),
                     **{k: best.get(k) for k in SWEEP_COLUMNS[3:]}})
    if PartialState().is_main_process:
        write_table(rows, root)
    PartialState().destroy_process_group()
    return rows


def write_table(rows: list[dict], root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    atomic_write(root / "sweep.md", md_table(SWEEP_COLUMNS, [[r[c] for c in SWEEP_COLUMNS] for r in rows]) + "\n")
    log.info(f"sweep table: {root / 'sweep.md'}, {root / 'sweep.csv'}")


def parser(prog: str = "train.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help(TrainConfig),
        description="Train SpecDec++ acceptance heads. Run with `accelerate launch [--num_processes N] "
                    "[--mixed_precision bf16] train.py ...` for GPUs/DDP (the launcher's mixed precision wins "
                    "over the config's), or with plain python.")
    p.add_argument("--config", help="YAML file of the config keys below (configs/train/*.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied after the YAML")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    p.add_argument("--sweep", action="store_true", help="train the depths x w_rejs grid (resumes by itself)")
    return p


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the same arguments plus --resume, under the same launcher."""
    launcher = "accelerate launch train.py" if os.environ.get("ACCELERATE_MIXED_PRECISION") else "python train.py"
    args = [a for a in argv if a != "--resume"]
    return " ".join([launcher, *(shlex.quote(a) for a in args), "--resume"])


def _kind(path: str | None, overrides: list[str]) -> str:
    """The config's `kind` (a drafter config says `kind: drafter`; a head's says nothing), overrides last."""
    import yaml

    kind = "head"
    if path and Path(path).is_file():
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError:
            raw = None  # load_config reports it
        kind = raw.get("kind", kind) if isinstance(raw, dict) else kind
    for item in overrides:
        if item.startswith("kind="):
            kind = item.split("=", 1)[1]
    return kind


def main(argv: list[str] | None = None) -> int:
    """`train.py` / `adaptive-spec train`: 0 done, 2 bad input (one `error:` line), 130 Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    cfg = None
    try:
        if _kind(args.config, args.overrides) == "drafter":  # the feature drafter: training/drafter.py
            from .drafter import DrafterConfig, train_drafter

            cfg = load_config(DrafterConfig, args.config, args.overrides)
            train_drafter(cfg, resume=args.resume)
            return 0
        cfg = load_config(TrainConfig, args.config, args.overrides)
        if args.sweep:
            sweep(cfg)
        else:
            train(cfg, resume=args.resume)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Every process gets the Ctrl-C; one line, from the main one, says what is kept and what to run.
        if int(os.environ.get("RANK", "0")) == 0:
            kept = RunFiles(Path(cfg.output_dir), False).last_checkpoint() if cfg else "nothing started"
            print(f"\ninterrupted: {kept}; resume with: {resume_command(argv)}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
