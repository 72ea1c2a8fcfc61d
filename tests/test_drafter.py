"""The feature drafter (adaptive_spec/drafter/): its runner's bookkeeping against a teacher-forced pass, exactness
through it (chi-square on enumerated tiny models, with a broken control), greedy equality under every chain
policy, save/load, the states' resumable datagen, and a short training run whose loss falls."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding import sampling
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.drafter import data
from adaptive_spec.drafter.model import FeatureDrafter, Readout
from adaptive_spec.drafter.source import feature_pair, load_drafter
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.typed import policy_class
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model, save_model

GREEDY = SamplingParams(temperature=0)


def tiny_target(vocab=32, seed=2, scale=4.0, hidden=24):
    return make_model(vocab, hidden_size=hidden, layers=2, seed=seed, logit_scale=scale)


def state_seqs(model, lengths, seed: int) -> list[dict]:
    """Random token sequences with the target's own states along them: what drafter/data.py stores."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        out.append({"ids": ids, "hidden": model.base_model(input_ids=ids.view(1, -1)).last_hidden_state[0].detach()})
    return out


def drafter_pair(model, seed=0):
    torch.manual_seed(seed)
    d = FeatureDrafter.for_target(model)
    return feature_pair(CausalLM(model), model, d)


def teacher_logits(model, drafter, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's logits at every slot with the target's own states, in one pass (what training computes)."""
    readout = Readout(model)
    with torch.no_grad():
        f = model.base_model(input_ids=ids.view(1, -1)).last_hidden_state
        out = drafter(f[:, :-1], readout.embed(ids[1:].view(1, -1)), torch.arange(len(ids) - 1).view(1, -1))
        return readout.logits(readout.feature(out))[0]


def test_runner_reads_the_targets_states_like_a_teacher_forced_pass():
    """Slot s holds (f_s, x_{s+1}): the runner's logits after a prefill equal the one-pass computation; a draft
    step past the target's length reads the drafter's own f^, and once the target has verified those positions
    the slots are fed again with its real states (the same logits as a fresh teacher-forced pass)."""
    model = tiny_target()
    tap, fr = drafter_pair(model)
    ids = torch.tensor([5, 9, 4, 17, 8, 6, 11, 12])
    want = teacher_logits(model, fr.drafter, ids)
    tap.forward(ids[:5], n_logits=0)  # the target holds positions 0..4
    got, _ = fr.forward(ids[:6], n_logits=2)  # slots 0..4, all with real states
    torch.testing.assert_close(got, want[3:5], rtol=1e-4, atol=1e-4)
    assert fr.real == fr.slots == 5
    step, _ = fr.forward(ids[6:7], n_logits=1)  # slot 5 needs f_5: not held yet, so f^_5
    assert fr.real == 5 and fr.slots == 6
    assert not torch.allclose(step[0], want[5], atol=1e-4)  # f^_5 is not f_5 (a random drafter)
    tap.forward(ids[5:8], n_logits=1)  # the target verifies x_5..x_7
    again, _ = fr.forward(ids[7:8], n_logits=2)  # slot 5 fed again with f_5, then slot 6
    torch.testing.assert_close(again, want[5:7], rtol=1e-4, atol=1e-4)
    assert fr.real == fr.slots == 7
    fr.rollback(4)
    assert fr.length == 4 and fr.slots == fr.real == 3


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_greedy_target(k):
    model = tiny_target()
    tap, fr = drafter_pair(model)
    prompt = [5, 9, 4, 17]
    ref = Decoder(CausalLM(model)).generate(prompt, max_new_tokens=40, sampling=GREEDY).token_ids
    g = Decoder(tap, fr).generate(prompt, max_new_tokens=40, sampling=GREEDY, policy=FixedK(k))
    assert g.token_ids == ref
    assert g.metrics.n_drafted > 0 and g.metrics.n_draft_forwards > 0


CHAIN = ["fixed", "learned", "confidence", "entropy", "heuristic", "oracle", "ngram", "ngram+learned"]


@pytest.mark.parametrize("name", CHAIN)
def test_every_chain_policy_runs_with_the_drafter(name):
    """Greedy output through the drafter equals the target's under every chain policy (the drafter's hidden
    state is the target's size, so a head reads it like any draft's)."""
    model = tiny_target()
    tap, fr = drafter_pair(model)
    prompt = [5, 9, 4, 17, 5, 9, 4]  # a repeat, so prompt lookup copies
    ref = Decoder(CausalLM(model)).generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    base, _, extra = name.partition("+")
    learned = "learned" in (base, extra)
    fields = policy_class(base).model_fields
    kw = {k: v for k, v in dict(head=AcceptanceHead(24, depth=1), threshold=0.5, k=3).items()
          if k in fields and (k != "head" or learned) and (k != "threshold" or base != "ngram" or learned)}
    if extra:
        kw["fallback"] = extra
    ctx = PolicyContext(SimpleNamespace(target=tap, draft=fr, eos_token_ids=[]), prompt, GREEDY, 30)
    g = Decoder(tap, fr).generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=make_policy(base, ctx, **kw))
    assert g.token_ids == ref


@pytest.mark.parametrize("cls", ["StaticCausalLM", "FusedCausalLM"])
def test_a_compiled_target_feeds_the_drafter_every_rows_state(cls):
    """The target on a graph runtime (torch.compile, traced only here) with its verify shapes warmed for
    forward_hidden: every pass after the prefill goes through the compiled rows step, the tap holds the target's
    own state of every position it kept, and greedy output through the drafter equals the target's."""
    from adaptive_spec.backends import static_runner
    from test_static_runner import count_compiled_calls

    model = tiny_target()
    ref = Decoder(CausalLM(model)).generate([5, 9, 4, 17], max_new_tokens=40, sampling=GREEDY).token_ids
    target = getattr(static_runner, cls)(model, max_cache_len=64, compile=True, compiler="eager")
    target.warmup(static_runner.verify_shapes(3), rows=True)
    calls = count_compiled_calls(target)
    torch.manual_seed(0)
    tap, fr = feature_pair(target, model, FeatureDrafter.for_target(model))
    g = Decoder(tap, fr).generate([5, 9, 4, 17], max_new_tokens=40, sampling=GREEDY, policy=FixedK(3))
    assert g.token_ids == ref
    assert len(calls) == g.metrics.n_target_forwards > 0 and all(c[-1] for c in calls)  # the rows variant
    seq = torch.tensor([5, 9, 4, 17] + ref)[: tap.length]
    with torch.no_grad():
        want = model.base_model(input_ids=seq.view(1, -1)).last_hidden_state[0]
    torch.testing.assert_close(tap.features(0, tap.length), want, rtol=1e-5, atol=1e-5)


# ---- exact output distribution ---------------------------------------------------------------

V, L, N = 5, 3, 1500


def _exact_setup():
    model = tiny_target(vocab=V, seed=3, scale=3.0, hidden=16)
    tap, fr = drafter_pair(model, seed=1)
    params, prompt = SamplingParams(1.0), [1, 2]
    return tap, fr, exact_sequence_probs(CausalLM(model), prompt, params, V, L), params, prompt


def test_distribution_through_the_drafter_is_exact():
    tap, fr, probs, params, prompt = _exact_setup()
    counts = sample_counts(Decoder(tap, fr), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def test_distribution_test_catches_a_wrong_residual_through_the_drafter(monkeypatch):
    """The same test fails when the correction after a rejection is drawn from p instead of the residual."""
    tap, fr, probs, params, prompt = _exact_setup()
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    counts = sample_counts(Decoder(tap, fr), prompt, params, FixedK(2), N, L)
    assert chi_square_pvalue(counts, probs, N) < 1e-3


def test_reduced_vocabulary_keeps_the_output_exact_and_q_zero_elsewhere():
    model = tiny_target()
    kept = torch.tensor([1, 4, 5, 9, 17, 20])
    torch.manual_seed(0)
    tap, fr = feature_pair(CausalLM(model), model, FeatureDrafter.for_target(model), kept_ids=kept)
    tap.forward(torch.tensor([5, 9, 4]), n_logits=0)
    logits, _ = fr.forward(torch.tensor([5, 9, 4, 17]), n_logits=1)
    outside = torch.ones(32, dtype=torch.bool)
    outside[kept] = False
    assert torch.isinf(logits[0, outside]).all() and torch.isfinite(logits[0, kept]).all()
    ref = Decoder(CausalLM(model)).generate([5, 9, 4, 17], max_new_tokens=30, sampling=GREEDY).token_ids
    tap, fr = feature_pair(CausalLM(model), model, fr.drafter, kept_ids=kept)
    assert Decoder(tap, fr).generate([5, 9, 4, 17], max_new_tokens=30, sampling=GREEDY,
                                     policy=FixedK(3)).token_ids == ref


# ---- save / load ---------------------------------------------------------------------------------

def test_save_load_round_trip_and_refusals(tmp_path):
    model = tiny_target()
    torch.manual_seed(0)
    d = FeatureDrafter.for_target(model, name="tiny-target", fingerprint="fp")
    with torch.no_grad():
        d.fc.weight.add_(0.01 * torch.randn_like(d.fc.weight))
    d.save_pretrained(tmp_path / "d", extra={"step": 7})
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["format"] == "adaptive_spec.drafter.v1" and cfg["layer_config"]["num_hidden_layers"] == 1
    back = load_drafter(f"feature:{tmp_path / 'd'}", hidden_size=24)
    assert back.extra["step"] == 7 and back.target_model == "tiny-target"
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    ids = torch.tensor([5, 9, 4, 17, 8])
    torch.testing.assert_close(teacher_logits(model, back, ids), teacher_logits(model, d, ids))
    with pytest.raises(UserError, match=r"\(hidden size 24\) but the target in use has hidden size 32"):
        load_drafter(f"feature:{tmp_path / 'd'}", hidden_size=32)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="is not a saved feature drafter"):
        load_drafter(f"feature:{tmp_path / 'x'}")
    with pytest.raises(UserError, match="does not exist"):
        load_drafter(f"feature:{tmp_path / 'nope'}")


def test_a_narrower_mlp_starts_from_the_targets_first_neurons_and_saves_in_bf16(tmp_path):
    """intermediate_size: the MLP keeps the target's last layer's first neurons (rows of gate/up, columns of
    down), everything else is copied whole; saved in bf16 it loads back at that width with those values."""
    model = tiny_target()  # intermediate size 48
    d = FeatureDrafter.for_target(model, intermediate_size=20)
    last, mlp = model.base_model.layers[-1], d.base.layers[0].mlp
    assert d.config_obj.intermediate_size == 20 and mlp.gate_proj.weight.shape == (20, 24)
    assert torch.equal(mlp.gate_proj.weight, last.mlp.gate_proj.weight[:20])
    assert torch.equal(mlp.up_proj.weight, last.mlp.up_proj.weight[:20])
    assert torch.equal(mlp.down_proj.weight, last.mlp.down_proj.weight[:, :20])
    assert not torch.equal(mlp.down_proj.weight, last.mlp.down_proj.weight[:, 28:])  # a control: another slice
    assert torch.equal(d.base.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    full = FeatureDrafter.for_target(model)
    assert full.config_obj.intermediate_size == 48
    assert sum(p.numel() for p in d.parameters()) < sum(p.numel() for p in full.parameters())
    d.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(str(tmp_path / "d" / "model.safetensors")).values()} == {torch.bfloat16}
    back = load_drafter(f"feature:{tmp_path / 'd'}", hidden_size=24)
    assert back.base.layers[0].mlp.down_proj.weight.shape == (24, 20)
    for (k, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16).float(), b.float()), k
    with pytest.raises(UserError, match="intermediate_size must be >= 0"):
        from adaptive_spec.training.drafter import DrafterConfig

        DrafterConfig(data="x", intermediate_size=-1).validate()


# ---- the states' datagen and training ----------------------------------------------------------------

def make_source(root: Path, model, seqs: dict, vocab=32, per_shard=4, seed=0) -> Path:
    """A datagen-format folder (the fields data.py reads) of the target's own samples."""
    g = torch.Generator().manual_seed(seed)
    man = {"format": "adaptive_spec.datagen.v1", "splits": {}, "complete": True}
    for split, n in seqs.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        shards = []
        for k, start in enumerate(range(0, n, per_shard)):
            ns = min(per_shard, n - start)
            rows, plens = [], []
            for _ in range(ns):
                prompt = torch.randint(4, vocab, (3,), generator=g)
                with torch.no_grad():
                    torch.manual_seed(int(torch.randint(0, 10**6, (1,), generator=g)))
                    out = model.generate(prompt.view(1, -1), max_new_tokens=24, do_sample=True, top_k=0,
                                         pad_token_id=0)[0]
                rows.append(out)
                plens.append(3)
            lens = torch.tensor([len(r) for r in rows])
            f = f"{split}/shard-{k:05d}.safetensors"
            save_file({"input_ids": torch.cat(rows).int(), "prompt_lens": torch.tensor(plens, dtype=torch.int32),
                       "input_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])},
                      str(root / f))
            shards.append({"file": f, "n_seqs": ns})
        man["splits"][split] = {"shards": shards}
    (root / "manifest.json").write_text(json.dumps(man))
    return root


def _load(model):
    return lambda: (model, {"name": "tiny", "hidden_size": 24, "fingerprint": "fp"})


def test_states_datagen_resumes_after_a_kill(tmp_path):
    model = tiny_target()
    src = make_source(tmp_path / "src", model, {"train": 10, "dev": 3})
    args = ({"target": "tiny"}, {"train": 9, "dev": 0})
    whole = data.build(src, tmp_path / "a", _load(model), *args, progress=False)
    assert whole["complete"] and whole["splits"]["train"]["n_seqs"] == 9 and whole["splits"]["dev"]["n_seqs"] == 3
    part = data.build(src, tmp_path / "b", _load(model), *args, progress=False, stop_after=2)
    assert not part["complete"] and len(part["splits"]["train"]["shards"]) + len(part["splits"]["dev"]["shards"]) == 2
    calls = []
    done = data.build(src, tmp_path / "b", lambda: calls.append(1) or _load(model)(), *args, progress=False)
    assert done["complete"] and calls == [1]
    for split in ("train", "dev"):
        for f in done["splits"][split]["shards"]:
            assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    seq = data.load_split(tmp_path / "b", "train")[0]
    want = model.base_model(input_ids=seq["ids"].view(1, -1)).last_hidden_state[0].to(torch.bfloat16)
    assert torch.equal(seq["hidden"], want)
    with pytest.raises(UserError, match=r"other settings \(max_len: 512 -> 8\)"):
        data.build(src, tmp_path / "b", _load(model), *args, max_len=8, progress=False)


def test_training_a_few_steps_lowers_the_loss_and_exports_a_drafter(tmp_path):
    from adaptive_spec.config import load_config
    from adaptive_spec.training.drafter import DrafterConfig, train_drafter

    # a sharp target: its next token depends on its state, so the cross-entropy has something to learn
    path = save_model(tmp_path / "target", vocab_size=32, hidden_size=24, layers=2, seed=2, logit_scale=30.0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    src = make_source(tmp_path / "src", model, {"train": 16, "dev": 4})
    cfg = load_config(DrafterConfig, None, [f"data={src}", f"target={path}", "target_dtype=fp32",
                                            f"output_dir={tmp_path / 'run'}", "report_to=none", "epochs=25",
                                            "batch_size=4", "lr=3e-3", "eval_every=1000", "save_every=0",
                                            "log_every=4", "warmup_ratio=0", "intermediate_size=32"])
    res = train_drafter(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals[-1]["dev_loss"] < 0.7 * evals[0]["dev_loss"], evals
    assert evals[-1]["dev_top1"] > evals[0]["dev_top1"] + 0.1 and evals[-1]["dev_accept"] > evals[0]["dev_accept"]
    assert res["best_step"] == evals[-1]["step"] == 100
    d = load_drafter(f"feature:{res['drafter']}", hidden_size=24)
    assert d.config_obj.intermediate_size == 32 and d.dtype == torch.float32  # written bf16, loaded as built
    tap, fr = feature_pair(CausalLM(model), model, d)
    ref = Decoder(CausalLM(model)).generate([5, 9, 4], max_new_tokens=30, sampling=GREEDY).token_ids
    g = Decoder(tap, fr).generate([5, 9, 4], max_new_tokens=30, sampling=GREEDY, policy=FixedK(3))
    assert g.token_ids == ref and g.metrics.n_accepted > 0


def test_the_pair_loads_a_feature_drafter_by_path(tmp_path):
    """`--draft feature:PATH` (SpecPair.load, as `generate` does): the drafter over the target, greedy output the
    target's; a drafter for another target is refused naming both sizes."""
    from adaptive_spec.decoding.pipeline import SpecPair

    path = save_model(tmp_path / "target", vocab_size=40, hidden_size=24, layers=2, seed=2, logit_scale=4.0)
    from transformers import AutoModelForCausalLM

    FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(path)).save_pretrained(tmp_path / "d")
    pair = SpecPair.load(target=str(path), draft=f"feature:{tmp_path / 'd'}", dtype="fp32", device="cpu")
    assert pair.draft_config["drafter"] == "feature"
    kw = dict(max_new_tokens=20, temperature=0, seed=0)
    ref = pair.generate("abc de", policy="ar", **kw).token_ids
    assert pair.generate("abc de", policy="fixed", k=3, **kw).token_ids == ref
    other = save_model(tmp_path / "other", vocab_size=40, hidden_size=32, layers=1, seed=1)
    with pytest.raises(UserError, match=r"\(hidden size 24\) but the target in use has hidden size 32"):
        SpecPair.load(target=str(other), draft=f"feature:{tmp_path / 'd'}", dtype="fp32", device="cpu")


def test_the_pair_loads_a_feature_drafter_on_a_compiled_target(tmp_path, monkeypatch):
    """`--draft feature:PATH --kv-cache static --runtime compile` loads (no longer refused) and its prepare warms the
    target's verify shapes for forward_hidden; greedy output is the target's. (torch.compile only traces here.)"""
    from adaptive_spec.backends import static_runner
    from adaptive_spec.decoding.pipeline import SpecPair
    from test_static_runner import count_compiled_calls

    class Traced(static_runner.StaticCausalLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, compiler="eager", **kw)

    monkeypatch.setattr(static_runner, "StaticCausalLM", Traced)
    path = save_model(tmp_path / "target", vocab_size=40, hidden_size=24, layers=2, seed=2, logit_scale=4.0)
    from transformers import AutoModelForCausalLM

    FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(path)).save_pretrained(tmp_path / "d")
    pair = SpecPair.load(target=str(path), draft=f"feature:{tmp_path / 'd'}", dtype="fp32", device="cpu",
                         kv_cache="static", runtime="compile")
    assert pair.target.runtime == "compile"
    pair.prepare(3, None)  # what generate calls first: here, so that the compiled calls are counted from now on
    assert {key[:4] for key in pair.target._warm} == {(n, n, False, True) for n in range(1, 5)}
    calls = count_compiled_calls(pair.target.runner)
    kw = dict(max_new_tokens=20, temperature=0, seed=0)
    got = pair.generate("abc de", policy="fixed", k=3, **kw).token_ids
    assert calls and all(c[-1] for c in calls)
    assert got == pair.generate("abc de", policy="ar", **kw).token_ids


def test_the_second_drafted_step_reads_the_first_steps_outputs():
    """rollout 2 (drafter_loss steps=2): the layer runs again with slot t + 1 reading step 1's f^_{t+1} (slot t's
    output, detached) and slot 0 keeping f_0, the same tokens and positions; its parts carry the suffix _2.
    Control: step 1 reads the target's own states."""
    from adaptive_spec.training.drafter import DrafterConfig, collate, drafter_loss

    model = tiny_target()
    d = FeatureDrafter.for_target(model, init_from_target=True).float()
    readout = Readout(model)
    feats, ids, valid = collate(state_seqs(model, (7, 5), seed=0))
    calls = []
    forward = d.forward

    def spy(f, e, pos, **kw):
        out = forward(f, e, pos, **kw)
        calls.append((f.detach().clone(), out.detach().clone()))
        return out

    d.forward = spy
    cfg = DrafterConfig(data="x", rollout=2)
    loss, parts = drafter_loss(d, readout, feats, ids, valid, cfg)
    assert len(calls) == 2 and {"top1", "top1_2", "accept_2", "ce_2"} <= set(parts)
    (f1, out1), (f2, _) = calls
    assert torch.equal(f1, feats[:, :-1].float())  # step 1: the target's own states
    assert torch.equal(f2[:, 0], f1[:, 0])
    assert torch.allclose(f2[:, 1:], readout.feature(out1)[:, :-1])
    loss.backward()  # one graph through both steps
    calls.clear()
    drafter_loss(d, readout, feats, ids, valid, DrafterConfig(data="x"))
    assert len(calls) == 1


def test_a_reduced_ce_vocabulary_trains_on_the_kept_ids_and_scores_against_the_full_target():
    """ce_vocab (EAGLE-3's reduced vocabulary): the CE over the kept ids alone, the target's p renormalized there;
    top-1 and acceptance still against the full p. Control: keeping every id gives the full loss; a strict subset
    changes the CE."""
    from adaptive_spec.training.drafter import DrafterConfig, collate, drafter_loss

    model = tiny_target()
    d = FeatureDrafter.for_target(model, init_from_target=True).float()
    seqs = state_seqs(model, (9, 6), seed=1)
    feats, ids, valid = collate(seqs)
    cfg = DrafterConfig(data="x")
    full = drafter_loss(d, Readout(model), feats, ids, valid, cfg)[1]
    every = drafter_loss(d, Readout(model, kept_ids=torch.arange(32)), feats, ids, valid, cfg)[1]
    assert all(abs(full[k] - every[k]) < 1e-4 for k in full), (full, every)

    kept = torch.tensor([0, 3, 4, 7, 9, 12, 15, 20, 21, 30])
    readout = Readout(model, kept_ids=kept)
    parts = drafter_loss(d, readout, feats, ids, valid, cfg)[1]
    with torch.no_grad():  # by hand: the same slots, the same f^
        m = valid[:, 1:]
        tgt = feats[:, 1:].float()[m]
        fhat = readout.feature(d(feats[:, :-1].float(), readout.embed(ids[:, 1:]),
                                 torch.arange(ids.shape[1] - 1).expand(len(seqs), -1)))[m]
        p_full = readout.full_logits(tgt).softmax(-1)
        p = readout.full_logits(tgt)[:, kept].softmax(-1)
        logq = readout.full_logits(fhat)[:, kept].log_softmax(-1)
    assert abs(parts["ce"] - float(-(p * logq).sum(-1).mean())) < 1e-4
    assert abs(parts["ce"] - full["ce"]) > 1e-3  # the subset is not a no-op
    assert abs(parts["top1"] - float((kept[logq.argmax(-1)] == p_full.argmax(-1)).float().mean())) < 1e-6
    assert abs(parts["accept"] - float(torch.minimum(p_full[:, kept], logq.exp()).sum(-1).mean())) < 1e-5
    for bad in ("0", str(Path("/nonexistent/list.safetensors"))):
        with pytest.raises(UserError, match="ce_vocab"):
            DrafterConfig(data="x", ce_vocab=bad).validate()


def test_a_reduced_readout_reads_the_kept_rows_back_from_a_packed_head_that_released_them():
    """`--draft feature:PATH --draft-vocab N` on the default CPU path: the target's LM head is pre-packed and its
    weight released; the readout's kept rows come back through the layer exactly. Control: the same rows from an
    unpacked copy."""
    from adaptive_spec.backends.cpu.packed import PackedLinear, pack_cpu_linears

    model = tiny_target(vocab=40, hidden=24)
    want = model.get_output_embeddings().weight.detach().clone()
    if pack_cpu_linears(model, release=True) == 0:
        pytest.skip(f"no packed oneDNN kernel for fp32 on this CPU ({model.cpu_path.get('why_stock')})")
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.weight.numel() == 0  # released: the case that broke
    kept = torch.tensor([1, 5, 6, 17, 39])
    readout = Readout(model, kept_ids=kept)
    assert torch.equal(readout.weight, want[kept])
    f = torch.randn(3, 24)
    assert torch.equal(readout.logits(f)[:, kept], torch.nn.functional.linear(f, want[kept]))


def test_a_drafter_reads_out_over_the_vocabulary_it_was_trained_on_unless_told():
    """readout_vocab: --draft-vocab where given (full included), else training's ce_vocab, else the whole."""
    from adaptive_spec.drafter.source import readout_vocab

    d = FeatureDrafter.for_target(tiny_target())
    assert readout_vocab(d) == "full"
    d.extra = {"ce_vocab": "32000"}
    assert readout_vocab(d) == "32000" and readout_vocab(d, "full") == "full" and readout_vocab(d, "8") == "8"


def _prompt_source(root: Path, tok, texts: list[str]) -> Path:
    """A datagen-format folder holding these prompts (chat-encoded), each with a short response."""
    from adaptive_spec.prompts import encode_prompt

    rows = [torch.tensor(encode_prompt(tok, t, chat=True) + [5, 6]) for t in texts]
    (root / "train").mkdir(parents=True)
    lens = torch.tensor([len(r) for r in rows])
    save_file({"input_ids": torch.cat(rows).int(), "input_offsets": torch.cat([torch.zeros(1, dtype=torch.long),
                                                                                lens.cumsum(0)]),
               "prompt_lens": torch.tensor([len(r) - 2 for r in rows], dtype=torch.int32)},
              str(root / "train" / "shard-00000.safetensors"))
    (root / "manifest.json").write_text(json.dumps({"format": "adaptive_spec.datagen.v1", "complete": True, "splits": {
        "train": {"shards": [{"file": "train/shard-00000.safetensors", "n_seqs": len(rows)}]}}}))
    return root


def test_reference_answers_train_on_prompts_the_data_lacks_and_resume(tmp_path, tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaptive_spec.prompts import answer_ids, encode_prompt
    from adaptive_spec.training.drafter import DrafterConfig

    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    pairs = [(f"ab {c}", f"cd {c} e") for c in "abcdefg"]
    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs)
                    + json.dumps({"prompt": "ab a", "answer": "dd"}) + "\n")  # a repeated prompt: taken once
    src = _prompt_source(tmp_path / "src", tok, ["ab c", "ab f"])  # two prompts the data already holds
    seqs = data.reference_sequences(tok, {str(refs): 5}, data.prompt_keys(src), prompt_tail=2, max_len=64)
    by_answer = {tok.decode(answer_ids(tok, p, a)): p for p, a in pairs + [("ab a", "dd")]}
    prompts_taken = [by_answer[tok.decode(ids[keep:])] for ids, keep in seqs]
    assert sorted(prompts_taken) == ["ab a", "ab b", "ab d", "ab e", "ab g"]  # each once, none the data holds
    for (ids, keep), p in zip(seqs, prompts_taken):
        assert keep == 2 and ids[:keep].tolist() == encode_prompt(tok, p, chat=True)[-2:]
    full = encode_prompt(tok, "ab b", chat=True) + answer_ids(tok, "ab b", "cd b e")
    assert tok.decode(full) == tok.apply_chat_template([{"role": "user", "content": "ab b"},
                                                        {"role": "assistant", "content": "cd b e"}], tokenize=False)
    with pytest.raises(UserError, match="has 5 usable .* fewer than the 6 asked"):
        data.reference_sequences(tok, {str(refs): 6}, data.prompt_keys(src), 2, 64)

    load = lambda: (model, {"name": "tiny", "hidden_size": 24, "fingerprint": "fp"})  # noqa: E731
    args = (src, tmp_path / "r", load, lambda: tok, {"target": "tiny"}, {str(refs): 5}, 2, 64)
    part = data.build_references(*args, per_shard=2, progress=False, stop_after=1)
    assert not part["complete"] and part["splits"]["train"]["n_seqs"] == 2
    done = data.build_references(*args, per_shard=2, progress=False)
    assert done["complete"] and done["splits"]["train"]["n_seqs"] == 5 and len(done["splits"]["train"]["shards"]) == 3
    back = data.load_split(tmp_path / "r", "train")
    assert [s["ids"].tolist() for s in back] == [ids.tolist() for ids, _ in seqs]
    want = model.base_model(input_ids=back[4]["ids"].view(1, -1)).last_hidden_state[0].to(torch.bfloat16)
    assert torch.equal(back[4]["hidden"], want)
    with pytest.raises(UserError, match="other settings"):
        data.build_references(*args[:5], {str(refs): 4}, 2, 64, per_shard=2, progress=False)
    with pytest.raises(UserError, match="references: gsm8k holds the benchmarks' prompts"):
        DrafterConfig(data="x", references={"gsm8k": 10}).validate()
