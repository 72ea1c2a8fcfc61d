"""Every config the repo ships loads: a key renamed in the code but not in configs/ would
otherwise surface only hours into a run on a user's machine."""
from pathlib import Path

import pytest

from adaptive_spec.config import config_help, load_config
from adaptive_spec.datagen.config import DatagenConfig
from adaptive_spec.errors import UserError
from adaptive_spec.evaluation.sweep import SweepConfig
from adaptive_spec.training.drafter import DrafterConfig
from adaptive_spec.training.settings import TrainConfig

ROOT = Path(__file__).resolve().parents[1] / "configs"
KINDS = {"sweep": SweepConfig, "datagen": DatagenConfig, "train": TrainConfig}
FILES = sorted(p for kind in KINDS for p in (ROOT / kind).glob("*.yaml"))


def test_every_kind_has_configs():
    assert {p.parent.name for p in FILES} == set(KINDS)


def config_class(path: Path) -> type:
    """A training config with `kind: drafter` is the feature drafter's (training/drafter.py)."""
    if path.parent.name == "train" and path.name.startswith("drafter_"):
        return DrafterConfig
    return KINDS[path.parent.name]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_config_loads(path):
    cfg = load_config(config_class(path), str(path), [])
    assert isinstance(cfg, config_class(path))


def test_trees_sweep_extends_the_final_sweep():
    """trees.yaml adds tree rows to final.yaml's out_dir: every other key must match, or its run
    would be refused (other settings) or rerun chain rows under another configuration."""
    final = load_config(SweepConfig, str(ROOT / "sweep" / "final.yaml"), [])
    trees = load_config(SweepConfig, str(ROOT / "sweep" / "trees.yaml"), [])
    assert trees.trees and not final.trees
    differ = {k for k in vars(final) if k != "trees" and getattr(final, k) != getattr(trees, k)}
    assert not differ, f"trees.yaml and final.yaml differ in {sorted(differ)}"


@pytest.mark.parametrize("cls, base", [(SweepConfig, []), (DatagenConfig, ["dataset=gsm8k-train"])])
def test_pair_settings_live_under_pair(cls, base):
    """The model pair is one mapping checked by PairParams, as `generate` checks its flags; a pair setting
    written at the top is refused saying where it goes."""
    with pytest.raises(UserError, match=r"draft_quant is a pair setting: write pair: \{draft_quant: ...\}, or "
                                        r"pair\.draft_quant=... on the command line; valid keys: "):
        load_config(cls, None, [*base, "draft_quant=int8"])
    with pytest.raises(UserError, match=r"draft, dtype are pair settings: write pair: \{draft: ...\}"):
        load_config(cls, None, [*base, "draft=x", "dtype=fp32"])
    with pytest.raises(UserError, match=r"pair\.draft_qant: not a setting of 'pair' \(its settings: pair\.target, "
                                        r"pair\.draft, "):
        load_config(cls, None, [*base, "pair={draft_qant: int8}"])
    with pytest.raises(UserError, match=r"pair\.draft_quant must be none, int8, int4 \(torch\), or q4_0, q8_0, q4_0-pure, q4_k-pure, iq4_nl-pure \(llama\.cpp\)"):
        load_config(cls, None, [*base, "pair.draft_quant=int3"])
    cfg = load_config(cls, None, [*base, "pair={draft_quant: int8, threads: 2}", "pair.dtype=fp32"])
    assert (cfg.pair.draft_quant, cfg.pair.threads, cfg.pair.dtype, cfg.pair.draft) == ("int8", 2, "fp32", "default")
    assert cfg.model_dump()["pair"]["draft_quant"] == "int8"
    assert "  pair.draft_quant ['none']" in config_help(cls)
