"""Trace replay (decoding/replay.py): a trace recorded with real weights, replayed on other weights of the
same shapes, does the same work and gives the same counts; and a sweep with record_trace keeps the traces."""
import json

import pytest
import torch

from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.backends.static_runner import StaticCausalLM
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.ngram import NgramPolicy
from adaptive_spec.decoding.policies import FixedK, HeuristicSchedule, LearnedThreshold
from adaptive_spec.decoding.replay import TraceRecorder, TraceReplay, check_trace, replay_generate
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.errors import UserError
from adaptive_spec.evaluation import sweep
from adaptive_spec.heads.head import AcceptanceHead
from tiny import make_model

V, EOS = 32, 1
COUNTS = ("n_tokens", "n_drafted", "n_accepted", "n_discarded", "n_final_cut", "accepted_hist", "target_pass_hist",
          "n_target_forwards", "n_draft_forwards", "n_drafted_by", "n_accepted_by", "rounds_by")


def pair(seed):
    """(draft, target) CausalLMs: tiny models of fixed shapes, weights from `seed`."""
    return (CausalLM(make_model(V, hidden_size=16, layers=2, seed=seed, logit_scale=4.0)),
            CausalLM(make_model(V, hidden_size=24, layers=2, seed=seed + 1, logit_scale=4.0)))


class Counting(FixedK):
    """FixedK that counts the steps it was asked about (the inner policy's cost must be paid)."""

    def __init__(self, k):
        super().__init__(k)
        self.asked = 0

    def should_stop(self, step):
        self.asked += 1
        return super().should_stop(step)


def head(hidden):
    torch.manual_seed(0)
    h = AcceptanceHead(hidden, depth=1)
    with torch.no_grad():
        h.out.bias.fill_(1.0)
    return h.eval()


def policies(draft):
    return {"fixed": lambda: FixedK(3), "heuristic": lambda: HeuristicSchedule(2, k_max=6),
            "learned": lambda: LearnedThreshold(head(draft.hidden_size), threshold=0.5, k_max=8)}


def traced(dec, *args, **kw):
    """dec.generate(*args, **kw) with a TraceRecorder attached: (the Generation, its trace)."""
    rec = TraceRecorder()
    return dec.generate(*args, extras=[rec], **kw), rec.rounds


def counts(m):
    d = m.to_dict()
    return {k: d[k] for k in COUNTS}


@pytest.mark.parametrize("name", ["fixed", "heuristic", "learned"])
def test_replay_on_other_weights_reproduces_the_counts(name):
    draft, target = pair(1)
    other_draft, other_target = pair(7)  # same shapes, other weights
    rec = Decoder(target, draft, eos_token_ids=[EOS])
    cuts = 0
    for seed in range(6):
        g, trace = traced(rec, [5, 9, 4, 7], 40, SamplingParams(1.0), policies(draft)[name](), seed=seed)
        m = g.metrics
        assert len(trace) == sum(m.accepted_hist.values()) and m.to_dict()["trace"] == trace
        cuts += m.n_final_cut
        inner = policies(other_draft)[name]()
        r = replay_generate(other_target, other_draft, [5, 9, 4, 7], m.n_tokens, trace, inner,
                            SamplingParams(1.0), seed=seed + 100)
        assert counts(r.metrics) == counts(m), (seed, trace)
        assert len(r.token_ids) == m.n_tokens
    assert cuts, "no recorded generation ended on an EOS among accepted candidates: the final cut went untested"


def test_replay_asks_the_inner_policy_at_every_drafted_step_and_records_again():
    draft, target = pair(1)
    g, trace = traced(Decoder(target, draft), [3, 4], 30, SamplingParams(1.0), FixedK(2), seed=0)
    m = g.metrics
    inner = Counting(5)  # its own K is ignored: the trace decides
    policy = TraceReplay(check_trace(trace, m.n_tokens), inner)
    g, again = traced(Decoder(*pair(3)[::-1]), [3, 4], m.n_tokens, SamplingParams(1.0), policy, seed=1)
    assert inner.asked == m.n_drafted == g.metrics.n_drafted
    assert again == trace  # a replay's own trace is the one it replayed


def test_replay_of_copied_and_empty_rounds():
    """Prompt lookup with a model fallback: rounds from the model, copied rounds and rounds of no candidates;
    a copied round replays as a copy (no draft forward)."""
    draft, target = pair(1)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    sources = set()
    for seed in range(4):
        for fallback in (None, FixedK(2)):
            pol = NgramPolicy(ngram_min=1, ngram_max=3, k=3, fallback=fallback)
            g, trace = traced(Decoder(target, draft), prompt, 24, SamplingParams(1.0), pol, seed=seed)
            m = g.metrics
            sources |= {s for _, _, s in trace}
            other_draft, other_target = pair(5)
            policy = TraceReplay(check_trace(trace, m.n_tokens), fallback, needs=pol.needs)
            r = Decoder(other_target, other_draft).generate(
                prompt, m.n_tokens, SamplingParams(1.0), policy, seed=seed).metrics
            assert counts(r) == counts(m)
    assert sources == {"model", "ngram", "none"}


def test_replay_through_static_runners():
    draft, target = pair(1)
    g, trace = traced(Decoder(target, draft, eos_token_ids=[EOS]), [2, 3], 30, SamplingParams(0.0), FixedK(4), seed=0)
    m = g.metrics
    d, t = (StaticCausalLM(make_model(V, hidden_size=h, layers=2, seed=9 + h), max_cache_len=64) for h in (16, 24))
    r = replay_generate(t, d, [2, 3], m.n_tokens, trace, FixedK(4), SamplingParams(0.0))
    assert counts(r.metrics) == counts(m)
    ar = replay_generate(t, d, [2, 3], 17, None)  # an ar row: the target alone, no trace
    assert ar.metrics.n_tokens == ar.metrics.n_target_forwards == 17 and ar.metrics.n_draft_forwards == 0


@pytest.mark.parametrize("trace, n, match", [
    ("x", 3, "a trace is a list of"),
    ([[2, 3, "model"]], 4, "round 0 is \\[2, 3, 'model'\\]"),
    ([[3, 1, "tree"]], 2, "tree and multi-draft traces"),
    ([[0, 0, "model"]], 1, "not a chain round"),
    ([[2, 1, "model"], [0, 0, "none"]], 7, "emit 3 tokens but the row has n_tokens 7"),
])
def test_bad_traces_are_refused(trace, n, match):
    with pytest.raises(UserError, match=match):
        check_trace(trace, n)


def test_a_replay_longer_than_its_trace_is_refused():
    draft, target = pair(1)
    policy = TraceReplay([[2, 2, "model"]])
    dec = Decoder(target, draft)
    with pytest.raises(UserError, match="the trace has 1 rounds but the replay needs more"):
        dec.generate([1, 2], 10, SamplingParams(1.0), policy)


def test_a_sweep_records_traces_and_the_pair(tiny_pair, tmp_path):
    draft, target = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc abc abc", "hello world")))
    out = tmp_path / "out"
    argv = [f"pair.draft={draft}", f"pair.target={target}", "pair.dtype=fp32", "pair.threads=1",
            f"datasets=[{prompts}]", "n_prompts=2", "max_new_tokens=12", "ks=[2]", "include_draft_ar=false",
            "policies=[{policy: ngram, k: 2}]", f"out_dir={out}", "progress=false", "record_trace=true"]
    assert sweep.main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ar", "fixed", "ngram"}
    for r in rows:
        if r["method"] == "ar":  # the target alone books no rounds
            assert r["trace"] == []
            continue
        check_trace(r["trace"], r["n_tokens"])
        assert len(r["trace"]) == sum(r["accepted_hist"].values())
    config = json.loads((out / "config.json").read_text())
    tp = config["trace_pair"]
    assert tp["draft"]["name"] == str(draft) and tp["draft"]["hub_id"] is None and tp["preset"] is None
    assert tp["target"]["vocab_size"] == 32 and len(tp["target"]["fingerprint"]) == 16
    assert json.loads((out / "settings.json").read_text())["settings"]["record_trace"] is True
    # off (the default): no trace in the rows, no trace_pair, the settings as before
    off = tmp_path / "off"
    assert sweep.main([a for a in argv if not a.startswith(("record_trace", "out_dir"))] + [f"out_dir={off}"]) == 0
    assert not any("trace" in json.loads(line) for line in (off / "results.jsonl").read_text().splitlines())
    assert "trace_pair" not in json.loads((off / "config.json").read_text())
    assert "record_trace" not in json.loads((off / "settings.json").read_text())["settings"]
