"""Train SpecDec++ acceptance heads; the logic lives in adaptive_spec/training.py.

    accelerate launch train.py --config configs/train/default.yaml [key=value ...] [--resume]
    python train.py --config configs/train/sweep.yaml --sweep
"""
from adaptive_spec.training import main

if __name__ == "__main__":
    main()
