"""The settings of a training run (`configs/train/*.yaml`, `key=value` overrides): TrainConfig."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config import Config
from ..errors import UserError
from ..heads.head import FEATURES, INPUTS, MAX_DEPTH

TARGETS = ("accept_prob", "expected_accept")
# Keys that may change between a run and its --resume without changing what it computes.
RUNTIME_KEYS = {"stop_after_steps", "report_to", "wandb_project", "run_name", "keep_checkpoints",
                "draft", "feature_cache", "depths", "w_rejs", "eval_batch_size"}


class TrainConfig(Config):
    data: str                          # dataset folder written by datagen (manifest.json + shards)
    output_dir: str = "runs/head"      # run folder: log.jsonl, checkpoints/, head/, results.json
    target: Literal[TARGETS] = "accept_prob"        # accept_prob = min(1, p/q) of the sampled token | expected_accept
    depth: int = 3                     # D residual blocks (0 = linear head); paper picks 3 or 4
    feature: Literal[FEATURES] = "token"             # token: e at Y_i's position (paper, one-step lag) | context: e that produced q_i (heads/head.py)
    inputs: Literal[INPUTS] = "hidden"             # hidden (paper) | hidden+stats: also log q(y), H(q), top-1 - top-2 of the draft (features.py) | stats: those alone (feature=context)
    w_rej: float = 6.0                 # weight of the rejection term (paper's best: 6, with h = 0.7)
    w_acc: float = 1.0
    epochs: int = 3
    batch_size: int = 32               # positions per optimizer step, summed over processes and accumulation
    grad_accum: int = 1                # gradient accumulation steps
    lr: float = 5e-5
    warmup_ratio: float = 0.03         # linear warm-up over this share of the steps, then cosine decay
    min_lr_ratio: float = 0.0          # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0         # 0 = no clipping
    init_bias: bool = True             # start at the best constant predictor (output bias set, output weights 0)
    seed: int = 0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"      # auto | no | bf16 | fp16; auto = bf16 on a GPU, no on CPU
    max_train_positions: int = 0       # 0 = all; else a fixed random subset (quick runs)
    max_dev_positions: int = 0         # 0 = all
    eval_train_positions: int = 100_000  # train metrics are measured on a fixed subset of this size
    eval_every: int = 1000             # steps; also evaluated at step 0 and at the end
    eval_batch_size: int = 8192
    ece_bins: int = 10
    log_every: int = 10                # steps between train-loss log rows
    save_every: int = 1000             # steps between checkpoints (0 = none)
    keep_checkpoints: int = 2
    stop_after_steps: int = 0          # testing: exit abruptly after this step, as if killed
    report_to: Literal["wandb", "none"] = "wandb"           # wandb | none (wandb is offline unless configured)
    wandb_project: str = "adaptive_spec"
    run_name: str = ""
    draft: str = ""                    # draft model for datasets without features ("" = manifest's)
    draft_dtype: str = "auto"          # for that draft pass: auto = bf16 on a GPU, fp32 on CPU
    feature_cache: str = ""            # where draft features are cached ("" = <output_dir>/features)
    partial_data: bool = False         # train on the shards written so far of a dataset datagen is still growing
    depths: list[int] = Field(default_factory=list)   # --sweep grid ([] = 0..4)
    w_rejs: list[float] = Field(default_factory=list)  # --sweep grid ([] = 1, 3, 6, 12)

    def validate(self) -> None:
        checks = [  # each key's own choices are its type's (Literal), refused on construction
            (self.inputs != "stats" or self.feature == "context",
             "inputs=stats reads no hidden state: set feature=context (it scores each candidate with no lag)"),
            (self.ece_bins >= 2, "ece_bins must be >= 2 (10 to 15 is usual)"),
            (all(0 <= d <= MAX_DEPTH for d in [self.depth, *self.depths]), f"depths must be in 0..{MAX_DEPTH}"),
            (self.w_rej > 0 and self.w_acc > 0 and all(w > 0 for w in self.w_rejs), "loss weights must be > 0"),
            (self.epochs > 0 and self.batch_size > 0 and self.grad_accum > 0, "epochs, batch_size, grad_accum must be > 0"),
            (self.lr > 0 and 0 <= self.warmup_ratio < 1, "lr must be > 0 and warmup_ratio in [0, 1)"),
            (self.eval_every > 0 and self.log_every > 0 and self.eval_batch_size > 0, "eval_every, log_every, eval_batch_size must be > 0"),
            (self.save_every >= 0 and self.keep_checkpoints >= 1, "save_every must be >= 0 and keep_checkpoints >= 1"),
            (bool(self.data), "data must name a dataset folder written by datagen"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(f"invalid training config: {msg}")
