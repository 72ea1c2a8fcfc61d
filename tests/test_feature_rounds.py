"""Head data for the feature drafter (adaptive_spec/datagen/feature_rounds.py): the simulated rounds' states and
labels against the decoder's runner stepping a real round, the folder's resume, and a head trained on it
driving the learned policy through the drafter with greedy output equal to the target's."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaptive_spec.backends.logits import process_logits
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.config import load_config
from adaptive_spec.datagen import feature_rounds
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.policies import LearnedThreshold
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.drafter import data
from adaptive_spec.drafter.model import FeatureDrafter, Readout
from adaptive_spec.drafter.source import feature_pair, load_drafter
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import load_head
from adaptive_spec.training import loop
from adaptive_spec.training.data import read_manifest
from adaptive_spec.training.settings import TrainConfig
from test_drafter import make_source, tiny_target
from tiny import save_model

T1 = SamplingParams(1.0, 8, 1.0)


def test_level_masks_follow_a_rounds_cache():
    m = feature_rounds.level_mask(5, 3)  # slot j at level 3: level-1 slots <= j - 2, level 2 at j - 1, itself
    assert m[4].nonzero()[:, 0].tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[1].nonzero()[:, 0].tolist() == [10 + 1]  # too early for level 3: only itself
    assert torch.equal(feature_rounds.level_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("start", [5, 9])
def test_simulated_rounds_are_the_runners_states_and_labels(start):
    """For a round that starts after x_s, the runner fed x_<=s and then the round's candidates Z^1_{s+1},
    Z^2_{s+2}, ... hands the decoder (as the head's input) exactly the state the data stores for depth d at
    position s + d; and the depth-1 label is min(1, p/q) with the runner's q and the target's p there."""
    model = tiny_target()
    torch.manual_seed(0)
    drafter = FeatureDrafter.for_target(model)
    readout = Readout(model)
    ids = torch.randint(0, 32, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = model.base_model(input_ids=ids.view(1, -1)).last_hidden_state[0]
        logits = model(input_ids=ids.view(1, -1)).logits[0]
    out = feature_rounds.simulate(drafter, readout, ids, feats, start, 3, T1, 0.3,
                                  torch.Generator().manual_seed(0))
    first = max(start, 4)
    assert [len(o["z"]) for o in out] == [16 - first] * 3
    for s in range(first - 1, 13):
        tap, fr = feature_pair(CausalLM(model), model, drafter)
        tap.forward(ids[:s], n_logits=0)  # the target holds x_<s; x_s is the round's last accepted token
        q_logits, _ = fr.forward(ids[:s + 1], n_logits=1)
        for d in range(1, 4):
            i = s + d
            if i >= 16:
                break
            if d == 1 and i >= first:
                q = process_logits(q_logits[0], T1)
                p = process_logits(logits[i - 1], T1)
                y = int(out[0]["y"][i - first])
                assert q[y] > 0
                torch.testing.assert_close(out[0]["accept_prob"][i - first], (p[y] / q[y]).clamp(max=1.0))
            z = out[d - 1]["z"][i - first] if i >= first else ids[i]
            _, hidden = fr.forward(torch.tensor([int(z)]), n_logits=1)
            if i >= first:
                torch.testing.assert_close(out[d - 1]["features"][i - first].float(), hidden.float(),
                                           rtol=1e-2, atol=1e-2)
    mixed = torch.cat([o["loss_mask"] for o in out]).float().mean()
    assert 0.5 < mixed < 0.9  # 1 - mix_ratio of the candidates carry the loss


def _pair(tmp_path):
    path = save_model(tmp_path / "target", vocab_size=32, hidden_size=24, layers=2, seed=2, logit_scale=4.0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    src = make_source(tmp_path / "src", model, {"train": 12, "dev": 4})
    states = tmp_path / "states"
    data.build(src, states, lambda: (model, {"name": str(path), "hidden_size": 24, "fingerprint": "fp"}),
               {"target": str(path)}, {"train": 0, "dev": 0}, progress=False)
    torch.manual_seed(1)
    FeatureDrafter.for_target(model).save_pretrained(tmp_path / "drafter")
    return model, states, str(tmp_path / "drafter")


def test_the_folder_resumes_trains_a_head_and_drives_the_learned_policy(tmp_path):
    model, states, drafter = _pair(tmp_path)
    kw = dict(depth=2, params=T1, max_seqs={"train": 0, "dev": 0}, dtype="fp32", progress=False)
    whole = feature_rounds.build(drafter, states, tmp_path / "a", **kw)
    assert whole["complete"] and whole["models"]["draft"]["fingerprint"].startswith("feature-")
    assert whole["splits"]["train"]["n_prompts"] == 2 * 12 and whole["splits"]["dev"]["n_prompts"] == 2 * 4
    part = feature_rounds.build(drafter, states, tmp_path / "b", **kw, stop_after=1)
    assert not part["complete"]
    done = feature_rounds.build(drafter, states, tmp_path / "b", **kw)
    for split in ("train", "dev"):
        for sh in done["splits"][split]["shards"]:
            assert (tmp_path / "a" / sh["file"]).read_bytes() == (tmp_path / "b" / sh["file"]).read_bytes()
    with pytest.raises(UserError, match="other settings"):
        feature_rounds.build(drafter, states, tmp_path / "b", **{**kw, "depth": 3})
    few = feature_rounds.build(drafter, states, tmp_path / "c", **{**kw, "max_seqs": {"train": 3, "dev": 0}})
    assert few["splits"]["train"]["n_prompts"] == 2 * 4  # whole states shards: a larger max_seqs extends it
    more = feature_rounds.build(drafter, states, tmp_path / "c", **kw)
    assert more["complete"] and [sh["file"] for sh in more["splits"]["train"]["shards"]] == \
        [sh["file"] for sh in whole["splits"]["train"]["shards"]]
    with pytest.raises(UserError, match="no drafter states"):
        feature_rounds.build(drafter, tmp_path / "a", tmp_path / "d", **kw)
    man = read_manifest(tmp_path / "a")
    assert man["models"]["draft"]["hidden_size"] == 24

    cfg = load_config(TrainConfig, None, [f"data={tmp_path / 'a'}", f"output_dir={tmp_path / 'head'}",
                                          "report_to=none", "epochs=4", "batch_size=32", "depth=1", "lr=1e-2", "w_rej=1",
                                          "eval_every=8", "save_every=0"])
    res = loop.train(cfg)
    assert res["best"]["dev_n"] == man["splits"]["dev"]["n_loss_tokens"] > 0  # every candidate that carries loss
    head = load_head(str(tmp_path / "head" / "head"), hidden_size=24)
    assert head.draft_model == f"feature:{drafter}" and head.draft_fingerprint == man["models"]["draft"]["fingerprint"]
    tap, fr = feature_pair(CausalLM(model), model, load_drafter(drafter, hidden_size=24))
    greedy = SamplingParams(temperature=0)
    ref = Decoder(CausalLM(model)).generate([5, 9, 4], max_new_tokens=30, sampling=greedy).token_ids
    g = Decoder(tap, fr).generate([5, 9, 4], max_new_tokens=30, sampling=greedy,
                                  policy=LearnedThreshold(head, threshold=0.7))
    assert g.token_ids == ref and g.metrics.n_drafted > 0
