"""autotune: the offline replay (closed forms, brute-force enumeration, the learned policy's own
stop rule), the saved curve, the pick, and threshold="auto" / k="auto" through SpecPair."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from adaptive_spec.decoding.auto import Costs, coef_of, predict_time
from adaptive_spec.decoding.auto import curve_replay as R
from adaptive_spec.decoding.auto import picker as AU
from adaptive_spec.heads import curve as CV
from adaptive_spec.training import autotune as A
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.decoding.interfaces import DraftStep
from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec.decoding.policies import LearnedThreshold
from tiny import make_model, make_tokenizer
from train_fixtures import make_dataset


def expected_counts(P, K, width):
    """(rounds, drafted, accepted, rounds with every candidate accepted, rounds of 0, 1, ..., width
    candidates) by enumerating every acceptance outcome of every round."""
    T = len(P)

    def from_(s):
        if s >= T:
            return np.zeros(5 + width)
        k = min(int(K[s]), T - s - 1)
        total, reach = np.zeros(5 + width), 1.0
        this = np.zeros(5 + width)
        this[:3], this[4 + k] = [1.0, k, 0.0], 1.0
        for a in range(k + 1):  # a accepted: the first a pass, then a rejection (or all k passed)
            p = reach * ((1.0 - P[s + a]) if a < k else 1.0)
            this[2], this[3] = a, float(a == k > 0)  # all accepted: the draft's next first step feeds two
            total += p * (this + from_(s + a + 1))
            if a < k:
                reach *= P[s + a]
        return total

    return from_(0)


def test_replay_is_the_exact_expectation():
    rng = np.random.default_rng(0)
    for T in (1, 2, 5, 9):
        P = rng.uniform(0, 1, T)
        P[rng.uniform(size=T) < 0.3] = 1.0  # many exact 1s and a 0, as min(1, p/q) gives
        P[0] = 0.0 if T > 3 else P[0]
        K = rng.integers(1, 5, T)
        got = R.replay(R.window_products(P, 5), K)
        assert got == pytest.approx(expected_counts(P, K, 5), abs=1e-12)
        assert got[0] + got[2] == pytest.approx(T)  # every response yields exactly T tokens
        assert got[4:].sum() == pytest.approx(got[0]) and got[4:] @ np.arange(6) == pytest.approx(got[1])
        assert 0 <= got[3] <= got[0] - got[4]  # only rounds that drafted can accept them all


@pytest.mark.parametrize("a", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_fixed_k_matches_the_closed_form(a, k):
    """Constant acceptance a: a round yields (1 - a^(K+1)) / (1 - a) tokens in expectation."""
    T = 10000
    rounds, drafted, accepted = R.replay(R.window_products(np.full(T, a), k), np.full(T, k))[:3]
    assert T / rounds == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=2e-3)
    assert accepted / drafted == pytest.approx((a - a ** (k + 1)) / (1 - a) / k, rel=2e-3)


class ValueHead:
    """A duck-typed head whose 'hidden state' is its own prediction."""

    depth = 0

    def __init__(self, feature):
        self.feature = feature

    def acceptance_prob(self, h):
        return h


@pytest.mark.parametrize("feature, lag", [("token", 1), ("context", 0)])
def test_stop_lengths_follow_the_learned_policy(feature, lag):
    """K(s) of the replay equals what LearnedThreshold decides when fed, step by step, the
    states the decoder hands it (token head: y_{i-1}'s at step i; context head: y_i's)."""
    rng = np.random.default_rng(1)
    phat = rng.uniform(0.3, 1.0, 40)
    k_max = 6
    for h in (0.1, 0.4, 0.8):
        K = R.stop_lengths(R.window_products(phat, k_max), h, k_max, lag)
        pol = LearnedThreshold(ValueHead(feature), h, k_max)
        for s in range(len(phat) - k_max):
            pol.begin_round(s)
            for i in range(1, k_max + 1):
                j = s + i - 1 - lag  # the position whose prediction arrives at step i
                hidden = torch.tensor(phat[j] if j >= s else 0.5, dtype=torch.float64)
                if pol.should_stop(DraftStep(i, None, None, None, hidden, s + i - 1)) or i == k_max:
                    break
            assert K[s] == i, (h, s)


def test_a_cheap_draft_picks_longer_rounds():
    T = 4000
    curve = {"fixed_k": [{"k": k, **R.counts_row(T, R.replay(R.window_products(np.full(T, 0.8), k), np.full(T, k)))}
                         for k in R.K_GRID], "thresholds": []}
    picks = {}
    for c in (0.05, 0.6):
        costs = Costs(c * 0.1, 0.1, 0.0, "key", "now")
        choice = AU.pick(curve, "k", costs)
        assert choice["value"] == max(choice["predicted"], key=choice["predicted"].get)
        assert choice["tokens_per_s"] == max(choice["predicted"].values())
        picks[c] = choice["value"]
    assert picks[0.05] > picks[0.6] >= 1
    # a per-candidate verification cost (t_cand) shortens the rounds the extended model picks
    slow_verify = AU.pick(curve, "k", Costs(0.005, 0.1, 0.02, "key", "now"))
    assert slow_verify["value"] < picks[0.05]
    assert AU.pick(curve, "k", Costs(0.005, 0.1, 0.02, "key", "now"), model="paper")["value"] == picks[0.05]


def test_auto_picks_the_target_alone_where_no_draft_length_pays():
    """A draft step as dear as a target step, or a low acceptance: every K predicts less than one
    target step a token, and auto decodes without drafting; a cheap draft keeps its K."""
    T = 4000
    curve = {"fixed_k": [{"k": k, **R.counts_row(T, R.replay(R.window_products(np.full(T, 0.5), k), np.full(T, k)))}
                         for k in R.K_GRID], "thresholds": []}
    dear = AU.pick(curve, "k", Costs(0.09, 0.1, 0.0, "key", "now"))
    assert dear["value"] == AU.AR and dear["tokens_per_s"] == pytest.approx(1 / 0.1)
    assert dear["tokens_per_s"] > max(dear["predicted"].values())
    cheap = AU.pick(curve, "k", Costs(0.002, 0.1, 0.0, "key", "now"))
    assert cheap["value"] != AU.AR and cheap["tokens_per_s"] > cheap["ar_tokens_per_s"]


def test_table_model_caps_rounds_where_long_passes_cost_more():
    """With per-length verification times, a pass of 7+ tokens costing double makes the h pick
    cap K at 5 (the cap pays, as predicted); a flat table predicts what the extended model does
    with t_cand 0; a user's k_max bounds the cap; without measured lengths it is the extended model."""
    rng = np.random.default_rng(1)
    T = 3000
    P = rng.beta(8, 1.5, T)
    AP, PH = R.window_products(P, 20), R.window_products(P, 20)  # a perfect head: p̂ = P

    def row(K):
        return R.counts_row(T, R.replay(AP, K))

    curve = {"k_max": 20, "fixed_k": [{"k": k, **row(np.full(T, k))} for k in R.K_GRID],
             "thresholds": [{"h": h, **row(R.stop_lengths(PH, h, 20, 0))} for h in R.H_GRID],
             "capped": [{"h": h, "k_max": c, **row(R.stop_lengths(PH, h, c, 0))} for c in R.CAP_GRID if c < 20
                        for h in R.H_GRID]}
    point = curve["thresholds"][5]
    assert sum(point["target_pass_hist"].values()) == pytest.approx(point["n_target_forwards"])
    step = Costs(0.03, 0.1, 0.0, "k", "now", (0.1,) * 6 + (0.2,) * 3)
    want = 0.03 * point["n_draft_forwards"] + sum((0.1 if int(n) <= 6 else 0.2) * c
                                                  for n, c in point["target_pass_hist"].items())
    assert predict_time(point, coef_of(step, "table")) == pytest.approx(want)
    s = AU.pick(curve, "h", step, model="table")
    assert "k_max" not in AU.pick(curve, "h", step)  # the default (extended) model picks h alone
    assert s["model"] == "table" and s["k_max"] <= 5 and s["tokens_per_s"] > max(s["predicted"].values())
    assert AU.pick(curve, "h", step, model="table", k_max=4)["k_max"] <= 4
    flat = Costs(0.03, 0.1, 0.0, "k", "now", (0.1,) * 9)
    assert AU.pick(curve, "h", flat, model="table")["predicted"] == pytest.approx(
        AU.pick(curve, "h", flat, model="extended")["predicted"])
    old = AU.pick(curve, "h", Costs(0.03, 0.1, 0.0, "k", "now"), model="table")
    assert old["model"] == "extended" and "k_max" not in old


@pytest.fixture
def head_and_data(tmp_path):
    torch.manual_seed(0)
    head_dir = tmp_path / "head"
    AcceptanceHead(16, depth=0).save_pretrained(head_dir)
    data = make_dataset(tmp_path / "data", hidden_size=16, seqs={"train": 4, "dev": 12})
    return head_dir, data


def test_curve_is_saved_beside_the_head_and_checked(head_and_data):
    head_dir, data = head_and_data
    path, curve = A.make_curve(str(head_dir), str(data))
    assert path == head_dir / CV.CURVE_NAME and json.loads(path.read_text()) == json.loads(json.dumps(curve))
    man = json.loads((data / "manifest.json").read_text())
    assert curve["n_tokens"] == man["splits"]["dev"]["n_tokens"] and curve["n_responses"] == 12
    assert [p["h"] for p in curve["thresholds"]] == list(R.H_GRID)
    assert [p["k"] for p in curve["fixed_k"]] == list(R.K_GRID)
    for p in curve["thresholds"] + curve["fixed_k"]:
        assert p["n_accepted"] + p["n_target_forwards"] == pytest.approx(curve["n_tokens"])
    assert curve["head"]["weights"] == CV.weights_hash(head_dir) and curve["data"]["split"] == "dev"
    assert CV.load_curve(head_dir, "h", str(head_dir))["k_max"] == 20
    AcceptanceHead(16, depth=0).save_pretrained(head_dir)  # retrained: the curve is stale
    with pytest.raises(UserError, match="other weights"):
        CV.load_curve(head_dir, "h", str(head_dir))


def test_missing_curve_names_the_command(head_and_data):
    head_dir, _ = head_and_data
    with pytest.raises(UserError) as e:
        CV.load_curve(head_dir, "h", str(head_dir))
    assert CV.CURVE_NAME in str(e.value) and f"adaptive-spec autotune --head {head_dir} --data" in str(e.value)


def test_auto_through_specpair(head_and_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    head_dir, data = head_and_data
    A.make_curve(str(head_dir), str(data))
    path = head_dir / CV.CURVE_NAME
    saved = json.loads(path.read_text())
    saved["data"]["sampling"] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # as datagen at T = 1 records
    path.write_text(json.dumps(saved))
    tok = make_tokenizer(32)
    # tiny models' measured costs make every h lose to the target alone: the pick is tested on the costs
    # of a cheap draft here, and on those of a dear one at the end
    cheap, dear = Costs(0.001, 0.01, 0.0, "cheap", "now"), Costs(0.0095, 0.01, 0.0, "dear", "now")
    monkeypatch.setattr(AU, "measure_costs", lambda pair, *a, **k: cheap)

    def measure_costs(pair):
        return cheap

    def new_pair():
        return SpecPair.from_models(make_model(32, 24, seed=2, logit_scale=4.0), tok, make_model(32, 16, seed=1, logit_scale=4.0),
                        tok)

    pair = new_pair()
    g = pair.generate([5, 6, 7], policy="learned", head=str(head_dir), threshold="auto", temperature=0,
                      max_new_tokens=12)
    curve = CV.load_curve(head_dir, "h")
    best = AU.pick(curve, "h", measure_costs(pair))
    err = capsys.readouterr().err
    assert g.auto["kind"] == "h" and g.auto["value"] == best["value"] and "auto: h = " in err
    assert "but this decode is greedy (temperature 0)" in err  # the curve replays T = 1 acceptance
    again = pair.generate([5, 6, 7], policy="learned", head=str(head_dir), threshold=best["value"], temperature=0,
                          max_new_tokens=12)
    assert again.token_ids == g.token_ids
    g = pair.generate([5, 6, 7], policy="fixed", k="auto", curve=str(head_dir / CV.CURVE_NAME), temperature=0,
                      max_new_tokens=12)
    k = AU.pick(curve, "k", measure_costs(pair))["value"]
    assert g.auto["value"] == k and max(map(int, g.metrics.accepted_hist)) <= k
    with pytest.raises(UserError, match="is for --policy learned"):
        pair.generate([5], policy="confidence", threshold="auto")
    with pytest.raises(UserError, match="made with k_max 20"):
        pair.generate([5], policy="learned", head=str(head_dir), threshold="auto", k_max=5)
    monkeypatch.setattr(AU, "measure_costs", lambda pair, *a, **k: dear)
    pair = new_pair()
    g = pair.generate([5, 6, 7], policy="learned", head=str(head_dir), threshold="auto", temperature=0,
                      max_new_tokens=12)
    assert g.auto["value"] == AU.AR and g.metrics.n_drafted == 0 and g.metrics.n_target_forwards == 12
    assert g.token_ids == again.token_ids  # greedy: the target alone gives the same tokens


def test_sampling_mismatch_warns_across_greedy_and_sampled():
    def curve(t):
        return {"data": {"sampling": {"temperature": t, "top_k": 50, "top_p": 1.0}}}

    assert "decode is greedy" in CV.sampling_mismatch(curve(1.0), 0.0)
    assert "decode is sampled (temperature 0.7)" in CV.sampling_mismatch(curve(0.0), 0.7)
    assert CV.sampling_mismatch(curve(1.0), 0.7) is None and CV.sampling_mismatch(curve(0.0), 0.0) is None
    assert CV.sampling_mismatch(curve(None), 0.0) is None and CV.sampling_mismatch({}, 0.0) is None
    assert CV.sampling_mismatch(curve(1.0), None) is None


def test_per_k_curve_without_a_head(head_and_data, tmp_path):
    _, data = head_and_data
    with pytest.raises(UserError, match="--out"):
        A.make_curve(None, str(data))
    path, curve = A.make_curve(None, str(data), out=str(tmp_path / "k.json"))
    assert curve["thresholds"] == [] and CV.load_curve(path, "k")["fixed_k"]
    with pytest.raises(UserError, match="without a head"):
        CV.load_curve(path, "h")
    costs = SimpleNamespace(t_draft=0.01, t_target=0.1, t_cand=0.0, to_dict=dict)
    assert AU.pick(curve, "k", costs)["value"] in R.K_GRID


def test_per_source_curves_add_up_to_the_pooled_one(head_and_data):
    """A datagen mix names each sequence's prompt source: the curve keeps counts per source too."""
    from safetensors.torch import load_file, save_file

    head_dir, data = head_and_data
    man = json.loads((data / "manifest.json").read_text())
    man["sources"] = [{"name": "code"}, {"name": "math"}]
    (data / "manifest.json").write_text(json.dumps(man))
    for sh in man["splits"]["dev"]["shards"]:
        t = load_file(str(data / sh["file"]))
        t["source_ids"] = torch.arange(sh["n_seqs"], dtype=torch.int32) % 2
        save_file(t, str(data / sh["file"]))
    _, curve = A.make_curve(str(head_dir), str(data))
    parts = curve["by_source"]
    assert set(parts) == {"code", "math"} and sum(p["n_responses"] for p in parts.values()) == 12
    assert sum(p["n_tokens"] for p in parts.values()) == curve["n_tokens"]
    for part in ("thresholds", "fixed_k"):
        for i, pooled in enumerate(curve[part]):
            for key in ("n_target_forwards", "n_drafted", "n_accepted"):
                assert pooled[key] == pytest.approx(sum(p[part][i][key] for p in parts.values()))
    assert AU.pick(parts["code"], "h", Costs(0.01, 0.1, 0.0, "k", "now"))["value"] in R.H_GRID
