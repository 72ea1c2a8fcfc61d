"""Every config the repo ships loads: a key renamed in the code but not in configs/ would
otherwise surface only hours into a run on a user's machine."""
from pathlib import Path

import pytest

from adaptive_spec.config import load_config
from adaptive_spec.datagen.generate import DatagenConfig
from adaptive_spec.evaluation.sweep import SweepConfig
from adaptive_spec.training.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1] / "configs"
KINDS = {"sweep": SweepConfig, "datagen": DatagenConfig, "train": TrainConfig}
FILES = sorted(p for kind in KINDS for p in (ROOT / kind).glob("*.yaml"))


def test_every_kind_has_configs():
    assert {p.parent.name for p in FILES} == set(KINDS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_config_loads(path):
    cfg = load_config(KINDS[path.parent.name], str(path), [])
    assert isinstance(cfg, KINDS[path.parent.name])


def test_trees_sweep_extends_the_final_sweep():
    """trees.yaml adds tree rows to final.yaml's out_dir: every other key must match, or its run
    would be refused (other settings) or rerun chain rows under another configuration."""
    final = load_config(SweepConfig, str(ROOT / "sweep" / "final.yaml"), [])
    trees = load_config(SweepConfig, str(ROOT / "sweep" / "trees.yaml"), [])
    assert trees.trees and not final.trees
    differ = {k for k in vars(final) if k != "trees" and getattr(final, k) != getattr(trees, k)}
    assert not differ, f"trees.yaml and final.yaml differ in {sorted(differ)}"
