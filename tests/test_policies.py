"""Stop policies: SpecDec++'s learned threshold, heuristics and the hindsight oracle."""
import json

import pytest
import torch

from adaptive_spec.cli import main
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.heads.features import draft_stats, step_stats
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec import registry
from adaptive_spec.decoding.interfaces import RoundOwner, RoundState, StopPolicy, register
from adaptive_spec.decoding.pipeline import make_policy, policy_names
from adaptive_spec.decoding.policies import (ConfidenceThreshold, EntropyThreshold, FixedK, HeuristicSchedule, HindsightOracle,
                                    LearnedThreshold)
from adaptive_spec.decoding.sampling import SamplingParams, process_logits
from test_decoding import chi_square_pvalue, exact_pair, exact_sequence_probs, pair, sample_counts

GREEDY = SamplingParams(0.0)


def random_head(hidden_size, seed=0, depth=2, bias=1.0):
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden_size, depth=depth)
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head.eval()


def policies_for(hidden_size):
    return {
        "learned": LearnedThreshold(random_head(hidden_size), threshold=0.5, k_max=6),
        "confidence": ConfidenceThreshold(0.5, k_max=6),
        "entropy": EntropyThreshold(0.8, k_max=6),
        "heuristic": HeuristicSchedule(2, k_max=6),
    }


@pytest.mark.parametrize("name", ["learned", "confidence", "entropy", "heuristic"])
def test_greedy_equals_target(name):
    draft, target = pair()
    dec = Decoder(target, draft)
    prompt = [5, 9, 4, 17]
    ref = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY).token_ids
    g = dec.generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=policies_for(draft.hidden_size)[name])
    assert g.token_ids == ref


@pytest.mark.parametrize("name", ["learned", "confidence", "entropy", "heuristic"])
def test_distribution_is_exact(name):
    draft, target = exact_pair()
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    pol = policies_for(draft.hidden_size)[name]
    if name == "learned":  # a head that sometimes stops after 1-2 candidates on the mock
        pol = LearnedThreshold(random_head(draft.hidden_size, seed=3, bias=0.5), threshold=0.6, k_max=4)
    counts = sample_counts(Decoder(target, draft), prompt, params, pol, n=2000)
    assert chi_square_pvalue(counts, probs, 2000) > 1e-3


class RecordingHead(torch.nn.Module):
    """Predicts acceptance p for every hidden state and records what it was shown."""

    def __init__(self, p):
        super().__init__()
        self.p, self.seen = p, []
        self.depth = 0

    def acceptance_prob(self, h):
        self.seen.append(h.clone())
        return torch.tensor(self.p)


def test_stop_rule_and_one_step_lag():
    """With p_hat = 0.8 for every token and h = 0.5: 1 - 0.8^j > 0.5 first at j = 4 scored
    tokens. Scoring lags one token, so the round stops right after drafting y_5 (K = 5), and the
    head saw the hidden states of y_1..y_4 only (the MockLM's hidden state is [token, length])."""
    draft, target = exact_pair()
    head = RecordingHead(0.8)
    pol = LearnedThreshold(head, threshold=0.5, k_max=20)
    dec = Decoder(target, draft)
    g = dec.generate([1, 2], max_new_tokens=7, sampling=SamplingParams(1.0), policy=pol, seed=0)
    # first round: K = 5 candidates, unless max length cut it (7 new tokens allow 6)
    first_round_k = len(head.seen) + 1
    assert first_round_k == 5 or g.metrics.n_target_forwards > 1
    seen_tokens = [int(h[0]) for h in head.seen[:4]]
    seen_lengths = [int(h[1]) for h in head.seen[:4]]
    # prompt [1, 2] -> y_1 sits at position 2 (length 3 once fed); e_j is the state after feeding y_j
    assert seen_lengths == [3, 4, 5, 6]
    assert g.metrics.n_drafted >= 5
    assert len(seen_tokens) == 4


def test_context_head_has_no_lag():
    """A `context` head scores y_i from the state that produced q_i, at step i itself: with
    p_hat = 0.8 and h = 0.5 the round stops right after y_4 (1 - 0.8^4 > 0.5), having shown the
    head the states of the round's first input and y_1..y_3 (lengths 2..5). With p_hat = 0.3 a
    round stops after its first candidate (K = 1), which a token head can never do."""
    draft, target = exact_pair()
    head = RecordingHead(0.8)
    head.feature = "context"
    dec = Decoder(target, draft)
    g = dec.generate([1, 2], max_new_tokens=7, sampling=SamplingParams(1.0),
                     policy=LearnedThreshold(head, threshold=0.5, k_max=20), seed=0)
    assert [int(h[1]) for h in head.seen[:4]] == [2, 3, 4, 5]
    assert g.metrics.n_drafted >= 4 and len(head.seen) >= 4
    low = RecordingHead(0.3)
    low.feature = "context"
    g = dec.generate([1, 2], max_new_tokens=12, sampling=SamplingParams(1.0),
                     policy=LearnedThreshold(low, threshold=0.5, k_max=20), seed=0)
    rounds = sum(g.metrics.accepted_hist.values())
    assert max(g.metrics.accepted_hist) <= 1 and g.metrics.n_drafted <= rounds  # K = 1 every round
    token = RecordingHead(0.3)
    g = dec.generate([1, 2], max_new_tokens=12, sampling=SamplingParams(1.0),
                     policy=LearnedThreshold(token, threshold=0.5, k_max=20), seed=0)
    rounds = sum(g.metrics.accepted_hist.values())
    assert g.metrics.n_drafted > 1.5 * rounds  # K = 2 but where the length cap cuts the last rounds


def _random_head_keeps_the_output_exact(feature: str, inputs: str, seed: int):
    """Chi-square of a learned policy with a random head against the target's exact distribution;
    returns (draft, target, policy) for further checks."""
    draft, target = exact_pair()
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    head = AcceptanceHead(draft.hidden_size, depth=1, feature=feature, inputs=inputs)
    torch.manual_seed(seed)
    with torch.no_grad():
        for prm in head.parameters():
            prm.normal_(0, 0.7)
    pol = LearnedThreshold(head.eval(), threshold=0.5, k_max=4)
    counts = sample_counts(Decoder(target, draft), prompt, params, pol, n=2000)
    assert chi_square_pvalue(counts, probs, 2000) > 1e-3
    return draft, target, pol


@pytest.mark.parametrize("feature", ["token", "context"])
def test_learned_context_head_exact(feature):
    draft, target, pol = _random_head_keeps_the_output_exact(feature, "hidden", seed=5)
    if feature == "context":
        g = Decoder(target, draft).generate([1, 2, 3], max_new_tokens=30, sampling=GREEDY, policy=pol)
        assert g.token_ids == Decoder(target, draft).generate([1, 2, 3], max_new_tokens=30, sampling=GREEDY).token_ids


def test_learned_policy_caps_at_k_max():
    draft, target = exact_pair()
    pol = LearnedThreshold(RecordingHead(1.0), threshold=0.5, k_max=3)  # never predicts a rejection
    g = Decoder(target, draft).generate([1, 2], max_new_tokens=30, sampling=SamplingParams(1.0), policy=pol)
    assert max(int(k) for k in g.metrics.accepted_hist) <= 3
    assert g.metrics.n_drafted <= 3 * g.metrics.n_target_forwards


def test_heuristic_schedule():
    pol = HeuristicSchedule(5, k_max=20)
    assert pol.begin_round(0) == 5
    pol.end_round(5, 5)
    assert pol.begin_round(0) == 7
    pol.end_round(7, 2)
    pol.end_round(6, 0)
    assert pol.begin_round(0) == 5
    for _ in range(10):
        pol.end_round(1, 0)
    assert pol.begin_round(0) == 1


def test_oracle_reaches_theorem_4_1(tiny_pair, monkeypatch):
    """Greedy oracle: same output as the target, zero discards, one target pass per
    disagreement (plus the last round)."""
    sp = SpecPair.load(target=str(tiny_pair[1]), draft=str(tiny_pair[0]), dtype="fp32", device="cpu")
    ids = sp.encode("abcab")
    ref = sp.generate(ids, policy="ar", temperature=0, max_new_tokens=40)
    g = sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40)
    assert g.token_ids == ref.token_ids
    m = g.metrics
    assert m.n_discarded == 0
    # the disagreement set S, computed independently
    x = ref.token_ids
    lm = CausalLM(sp.draft.model)
    logits, _ = lm.forward(torch.tensor(ids + x), n_logits=len(x) + 1)
    s = {j for j in range(len(x)) if int(logits[j].argmax()) != x[j]}
    assert m.n_target_forwards == len(s | {len(x) - 1})
    # no fixed K beats it on target passes
    for k in (1, 2, 4, 8):
        assert sp.generate(ids, policy="fixed", k=k, temperature=0, max_new_tokens=40).metrics.n_target_forwards \
            >= m.n_target_forwards
    # X handed in (as the sweep does from its target-alone run) gives the same oracle, no target decode
    calls = []
    real = Decoder.generate
    monkeypatch.setattr(Decoder, "generate", lambda self, *a, **kw: calls.append(self.draft) or real(self, *a, **kw))
    g2 = sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40, target_output=x)
    monkeypatch.undo()
    assert len(calls) == 1  # only the oracle's own speculative decode, no hindsight target decode
    assert g2.token_ids == x and g2.metrics.n_target_forwards == m.n_target_forwards
    with pytest.raises(UserError, match="target_output has 0 tokens"):
        sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40, target_output=[])


def test_oracle_rederives_after_divergence(tiny_pair):
    """If the output leaves X (in bf16: a near-tie that a verify round rounds the other way),
    the oracle must re-derive X and Y from the tokens produced, not over-draft on a stale list.
    Simulated exactly in fp32 by handing in an X that is wrong from position j on."""
    sp = SpecPair.load(target=str(tiny_pair[1]), draft=str(tiny_pair[0]), dtype="fp32", device="cpu")
    ids = sp.encode("abcab")
    x = sp.generate(ids, policy="ar", temperature=0, max_new_tokens=40).token_ids
    j = len(x) // 2
    lm = CausalLM(sp.draft.model)
    y_j = int(lm.forward(torch.tensor(ids + x[:j]), n_logits=1)[0][0].argmax())
    # a wrong X_j that the draft does not propose, and a tail that belongs to no real sequence
    wrong = next(t for t in range(sp.target.vocab_size) if t not in (x[j], y_j))
    bad_x = x[:j] + [wrong] + [(t + 7) % sp.target.vocab_size for t in x[j + 1:]]
    g = sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40, target_output=bad_x)
    assert g.token_ids == x  # verification keeps the output exact whatever the oracle believes
    m = g.metrics
    assert m.n_discarded == 0  # the round reaching j stops before it (agree[j] is False); then X is rebuilt
    assert m.to_dict()["hindsight_s"] > 0  # the oracle's untimed work (policies.Hindsight)
    # the re-derived oracle is the true one from j on: one target pass per disagreement, plus
    # at most one extra round (the one that ended at j)
    ref = sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40, target_output=x).metrics
    assert ref.to_dict()["hindsight_s"] == 0 and ref.n_discarded == 0
    assert ref.n_target_forwards <= m.n_target_forwards <= ref.n_target_forwards + 1


def test_oracle_stops_where_the_running_draft_leaves_x(tiny_pair):
    """Y, the draft's greedy tokens, comes from one teacher-forced pass; the running draft's one-row
    steps may round a near-tie the other way (int8 / packed kernels differ by row count). Simulated
    by an oracle told that the draft agrees with X everywhere: each round must still stop at the
    first drafted token that is not X's, so every disagreement costs one discarded token, never a
    round of k_max, and the target passes stay the true oracle's."""
    sp = SpecPair.load(target=str(tiny_pair[1]), draft=str(tiny_pair[0]), dtype="fp32", device="cpu")
    ids = sp.encode("abcab")
    x = sp.generate(ids, policy="ar", temperature=0, max_new_tokens=40).token_ids
    lm = CausalLM(sp.draft.model)
    logits, _ = lm.forward(torch.tensor(ids + x), n_logits=len(x) + 1)
    s = {j for j in range(len(x)) if int(logits[j].argmax()) != x[j]}
    assert s, "the tiny pair must disagree somewhere for this test to mean anything"
    ref = sp.generate(ids, policy="oracle", temperature=0, max_new_tokens=40, target_output=x).metrics
    g = sp.decoder.generate(ids, max_new_tokens=40, sampling=SamplingParams(0.0),
                            policy=HindsightOracle([True] * len(x), k_max=20, x=x))
    assert g.token_ids == x
    assert 0 < g.metrics.n_discarded <= len(s)  # one per disagreement at most (k_max 20 each before the fix)
    assert g.metrics.n_target_forwards == ref.n_target_forwards


def test_oracle_refuses_sampling(tiny_pair, capsys):
    code = main(["generate", "--prompt", "ab", "--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1]),
                 "--dtype", "fp32", "--policy", "oracle", "--temperature", "1"])
    assert code == 2 and "greedy" in capsys.readouterr().err


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory, tiny_pair):
    root = tmp_path_factory.mktemp("heads")
    good = random_head(16).save_pretrained(root / "good")  # the tiny draft's hidden size is 16
    bad = random_head(24).save_pretrained(root / "bad")
    return good, bad


def test_learned_policy_cli(tiny_pair, head_dirs, capsys):
    draft, target = map(str, tiny_pair)
    code = main(["generate", "--prompt", "abc", "--draft", draft, "--target", target, "--dtype", "fp32",
                 "--policy", "learned", "--head", str(head_dirs[0]), "--threshold", "0.7", "--temperature", "0",
                 "--max-new-tokens", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["metrics"]["n_tokens"] == 20
    main(["generate", "--prompt", "abc", "--target", target, "--policy", "ar", "--dtype", "fp32",
          "--temperature", "0", "--max-new-tokens", "20", "--json"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]


@pytest.mark.parametrize("case,expect", [("h0", "must be h in (0, 1)"), ("h1", "must be h in (0, 1)"),
                                         ("other_draft", "hidden size"), ("no_head", "--head")])
def test_learned_policy_bad_input(case, expect, tiny_pair, head_dirs, capsys):
    draft, target = map(str, tiny_pair)
    args = {"h0": ["--head", str(head_dirs[0]), "--threshold", "0"],
            "h1": ["--head", str(head_dirs[0]), "--threshold", "1.5"],
            "other_draft": ["--head", str(head_dirs[1]), "--threshold", "0.5"],
            "no_head": ["--threshold", "0.5"]}[case]
    code = main(["generate", "--prompt", "abc", "--draft", draft, "--target", target, "--dtype", "fp32",
                 "--policy", "learned", *args])
    err = capsys.readouterr().err
    assert code == 2 and expect in err, err


class TwoChains(RoundOwner):
    """A round owner from outside the package: two chain rounds of K = 2 per call, booked by the
    decoder's public chain round."""

    name = "two-chains"

    def reset(self):
        self.calls = 0

    def run_round(self, state: RoundState) -> list[int]:
        self.calls += 1
        new = state.decoder.chain_round(state, FixedK(2))
        if len(new) >= state.remaining:
            return new
        state.seq = torch.cat([state.seq, torch.tensor(new)])
        state.pos, state.remaining = state.pos + len(new), state.remaining - len(new)
        return new + state.decoder.chain_round(state, FixedK(2))


def test_extension_points(monkeypatch):
    """A stop rule and a round owner registered by name reach the decoder through make_policy;
    the decoder tells them apart by interface (a round owner is not a stop rule)."""
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    register("two-chains")(lambda params, ctx: TwoChains())
    register("stop-at-2")(lambda params, ctx: type("StopAt2", (StopPolicy,), {"should_stop": lambda self, s: s.i == 2})())
    assert {"ar", "fixed", "tree", "two-chains", "stop-at-2"} <= set(policy_names())
    draft, target = pair()
    dec = Decoder(target, draft)
    ref = dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=GREEDY).token_ids
    with pytest.raises(UserError, match="k: not a setting of policy two-chains"):
        make_policy("two-chains", k=9)  # registered without settings: it takes none
    owner = make_policy("two-chains")
    g = dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=GREEDY, policy=owner)
    assert g.token_ids == ref and not isinstance(owner, StopPolicy)
    rounds = g.metrics.n_target_forwards
    assert sum(g.metrics.accepted_hist.values()) == rounds and 2 * owner.calls - 1 <= rounds <= 2 * owner.calls
    g = dec.generate([5, 9, 4, 17], max_new_tokens=30, sampling=GREEDY, policy=make_policy("stop-at-2"))
    assert g.token_ids == ref and max(g.metrics.accepted_hist) <= 2
    with pytest.raises(UserError, match="unknown policy 'nope'; valid policies: ar, "):
        make_policy("nope")


def test_head_trained_on_another_draft_configuration_warns(capsys):
    from adaptive_spec.heads.head import AcceptanceHead
    from adaptive_spec.decoding.policies import warn_draft_config

    head = AcceptanceHead(8, depth=0)
    head.extra = {"draft_quant": "none", "draft_vocab": "full"}
    warn_draft_config(head, {"draft_quant": "none", "draft_vocab": "full"})
    assert capsys.readouterr().err == ""
    warn_draft_config(head, {"draft_quant": "int8", "draft_vocab": "32768"})
    err = capsys.readouterr().err
    assert err.startswith("warning:") and "draft_quant none (trained) vs int8 (in use)" in err
    assert "draft_vocab full (trained) vs 32768 (in use)" in err and err.count("\n") == 1


# ---------------------------------------------------------------- heads that read the draft's own statistics

DATAGEN = SamplingParams(1.0, top_k=20, top_p=0.95)  # how the (imagined) datagen run processed q


class Recorder(LearnedThreshold):
    """The learned policy, keeping every DraftStep and each input row it shows the head (with the
    number of steps seen when it did)."""

    def __init__(self, head, threshold, k_max):
        super().__init__(head, threshold, k_max)
        self.steps, self.rows = [], []
        real = head.acceptance_prob
        head.acceptance_prob = lambda x: (self.rows.append((len(self.steps), x.clone())), real(x))[1]

    def should_stop(self, step):
        self.steps.append(step)
        return super().should_stop(step)


@pytest.mark.parametrize("decoding", [DATAGEN, GREEDY, SamplingParams(0.7)], ids=["as-datagen", "greedy", "t0.7"])
@pytest.mark.parametrize("feature", ["token", "context"])
def test_stats_head_rows_are_datagen_rows(feature, decoding):
    """Train/inference parity: at every scored draft step the policy shows the head [e, stats],
    stats = draft_stats of the scored token under q processed as datagen processed it, computed
    the way datagen computes them (a batch of steps at once), whatever the decoding temperature.
    A token head scores y_{i-1} at step i (its state arrives then); a context head scores y_i."""
    draft, target = pair()
    head = AcceptanceHead(draft.hidden_size, depth=1, feature=feature, inputs="hidden+stats",
                          stats_sampling={"temperature": 1.0, "top_k": 20, "top_p": 0.95})
    pol = Recorder(head.eval(), threshold=0.6, k_max=5)
    prompt = [5, 9, 4, 17]
    g = Decoder(target, draft).generate(prompt, max_new_tokens=30, sampling=decoding, policy=pol, seed=1)
    steps = pol.steps
    tokens = torch.stack([s.token for s in steps])
    want = draft_stats(process_logits(torch.stack([s.logits for s in steps]), DATAGEN), tokens)
    if decoding == DATAGEN:  # then the decoder's own q is datagen's q
        assert torch.equal(want, draft_stats(torch.stack([s.probs for s in steps]), tokens))
    scored = [j for j, s in enumerate(steps) if feature == "context" or s.i >= 2]
    assert [k - 1 for k, _ in pol.rows] == scored and len(scored) > 5
    for k, x in pol.rows:
        j = k - 1
        src = j - 1 if feature == "token" else j
        assert steps[src].i == steps[j].i - (feature == "token")  # the same round
        assert torch.equal(x, torch.cat([steps[j].hidden.float(), want[src]]))
    if decoding.greedy:
        assert g.token_ids == Decoder(target, draft).generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    assert pol.describe()["inputs"] == "hidden+stats"


def test_policy_stats_equal_the_stats_datagen_stored(tiny_pair, tmp_path):
    """End to end with the real datagen: at each response position, features.step_stats of the
    draft's logits after prompt + X_<i (what the policy computes when drafting there) and Y_i equal
    the draft_stats datagen stored (up to fp32 noise: datagen runs batched and left padded)."""
    from transformers import AutoModelForCausalLM

    from adaptive_spec.datagen import shards
    from test_datagen import TOP_K, TOP_P, _overrides, _run, _write_prompts

    _run(_overrides(tiny_pair, _write_prompts(tmp_path / "prompts.jsonl"), tmp_path / "dg"))
    params = SamplingParams(1.0, TOP_K, TOP_P)
    lm = CausalLM(AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval())
    n = 0
    for split in shards.SPLITS:
        for sh in shards.iter_shards(tmp_path / "dg", split):
            io_, ro = sh["input_offsets"], sh["resp_offsets"]
            for s in range(len(sh["prompt_lens"])):
                pl, r = int(sh["prompt_lens"][s]), slice(int(ro[s]), int(ro[s + 1]))
                x, y = sh["x_ids"][r].long(), sh["y_ids"][r].long()
                lm.reset()
                logits, _ = lm.forward(torch.cat([sh["input_ids"][io_[s]:io_[s] + pl].long(), x]), n_logits=len(x) + 1)
                got = torch.stack([step_stats(logits[i], y[i], params) for i in range(len(x))])
                torch.testing.assert_close(sh["draft_stats"][r], got, atol=1e-4, rtol=1e-4)
                n += len(x)
    assert n > 100


@pytest.mark.parametrize("feature", ["token", "context"])
def test_stats_head_keeps_the_output_exact(feature):
    _random_head_keeps_the_output_exact(feature, "hidden+stats", seed=6)


def test_stats_only_head_keeps_the_output_exact_and_stops_on_the_stats():
    """A head on the draft's statistics alone: exact, and its stop decisions follow q, not the state."""
    draft, target, pol = _random_head_keeps_the_output_exact("context", "stats", seed=7)
    assert pol.stats_params is not None and pol.describe()["inputs"] == "stats"
    g = Decoder(target, draft).generate([1, 2, 3], max_new_tokens=30, sampling=GREEDY, policy=pol)
    assert g.token_ids == Decoder(target, draft).generate([1, 2, 3], max_new_tokens=30, sampling=GREEDY).token_ids


def test_tree_estimator_refuses_a_stats_head():
    from adaptive_spec.decoding.trees.policy import load_tree_head

    with pytest.raises(UserError, match="tree_estimator 'head' can supply inputs hidden but this head was trained "
                                        "with inputs=hidden\\+stats"):
        load_tree_head(AcceptanceHead(8, depth=0, inputs="hidden+stats"), None)
