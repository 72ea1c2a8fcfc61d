"""Train SpecDec++ acceptance heads; the logic lives in adaptive_spec/training/ (its train.py: this command).

    accelerate launch train.py --config configs/train/default.yaml [key=value ...] [--resume]
    accelerate launch --num_processes 2 --mixed_precision bf16 train.py --config ...   # the launcher decides precision
    python train.py --config configs/train/sweep.yaml --sweep
"""
import sys

from adaptive_spec.training.train import main

if __name__ == "__main__":
    sys.exit(main())
