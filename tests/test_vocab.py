"""A reduced draft vocabulary (vocab.py): q is zero outside the kept tokens, the output is still
exactly the target's, including tokens the draft can never propose."""
from collections import Counter

import pytest
import torch

from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.errors import UserError
from adaptive_spec.backends.models import check_vocab, load_model
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams, entropy
from adaptive_spec.backends.vocab import SHIPPED, reduce_output_layer, resolve_draft_vocab, save_token_list
from exact import chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model, make_tokenizer

V, L = 5, 3


def reduced(seed, keep, vocab=V):
    m = make_model(vocab, hidden_size=32, layers=2, seed=seed, logit_scale=3.0)
    reduce_output_layer(m, torch.tensor(keep))
    return m


def test_draft_never_proposes_a_dropped_token():
    draft = CausalLM(reduced(9, [0, 1, 2]))
    logits, _ = draft.forward(torch.tensor([1, 2]), n_logits=1)
    assert logits.shape == (1, V) and torch.isinf(logits[0, 3:]).all() and torch.isfinite(logits[0, :3]).all()
    assert torch.isfinite(entropy(logits[0]))  # the entropy heuristic must not read nan


def test_reduced_draft_keeps_the_distribution_exact():
    """Tokens 3 and 4 are outside the draft's vocabulary: they still appear, at the target's
    probability, through the residual."""
    target = CausalLM(make_model(V, hidden_size=32, layers=2, seed=8, logit_scale=3.0))
    draft = CausalLM(reduced(9, [0, 1, 2]))
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params, V, L)
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), 1500, L)
    assert chi_square_pvalue(counts, probs, 1500) > 1e-3
    unproposable = sum(n for seq, n in counts.items() if {3, 4} & set(seq))
    expected = 1500 * sum(p for seq, p in probs.items() if {3, 4} & set(seq))
    assert expected > 50 and abs(unproposable - expected) < 5 * expected ** 0.5


def test_greedy_with_reduced_draft_equals_greedy_target():
    target = CausalLM(make_model(16, hidden_size=32, layers=2, seed=6, logit_scale=3.0))
    draft = CausalLM(reduced(7, list(range(0, 16, 2)), vocab=16))
    params = SamplingParams(0.0)
    ar = Decoder(target).generate([1, 2, 3], 24, params).token_ids
    assert any(t % 2 for t in ar)  # the target emits tokens the draft cannot
    assert Decoder(target, draft).generate([1, 2, 3], 24, params, FixedK(3)).token_ids == ar


def test_token_list_file_round_trip_and_errors(tmp_path, tiny_pair):
    draft_dir, target_dir = tiny_pair
    tok = make_tokenizer(32)
    path = save_token_list(tmp_path / "list.safetensors", tok, Counter({5: 10, 6: 7, 9: 7}), "test", always=[1])
    assert resolve_draft_vocab(str(path), tok, 32).tolist() == [1, 5, 6, 9]  # sorted ids
    assert resolve_draft_vocab(f"{path}:2", tok, 32).tolist() == [1, 5]
    assert len(resolve_draft_vocab(f"{path}:8", tok, 32)) == 8  # filled up with unseen ids
    for bad, msg in (("0", "must be in 1..32"), ("33", "must be in 1..32"), (f"{path}:0", "must be in 1..32"),
                     (str(tmp_path / "none.safetensors"), "does not exist")):
        with pytest.raises(UserError, match=msg):
            resolve_draft_vocab(bad, tok, 32)
    other = save_token_list(tmp_path / "other.safetensors", make_tokenizer(20), Counter({5: 1}), "test")
    with pytest.raises(UserError, match="counted with another tokenizer"):
        resolve_draft_vocab(str(other), tok, 32)
    with pytest.raises(UserError, match="shipped token list is for the Qwen2.5 tokenizer"):
        resolve_draft_vocab("16", tok, 32)
    d, dtok = load_model(str(draft_dir), "draft", "fp32", "cpu", draft_vocab=f"{path}:4")
    t, ttok = load_model(str(target_dir), "target", "fp32", "cpu")
    assert check_vocab(dtok, ttok, d, t) == 32 and CausalLM(d).kept_ids.tolist() == [1, 5, 6, 9]
    with pytest.raises(UserError, match="must be in 1..32"):
        load_model(str(draft_dir), "draft", "fp32", "cpu", draft_vocab="0")


def test_shipped_list_covers_the_default_tokenizer_specials():
    from safetensors import safe_open

    with safe_open(str(SHIPPED), "pt") as f:
        ids, meta = f.get_tensor("ids"), f.metadata()
    assert len(ids) >= 65536 and len(set(ids.tolist())) == len(ids)
    assert {151643, 151644, 151645} <= set(ids[:3].tolist())  # <|endoftext|>, <|im_start|>, <|im_end|> first
    assert "ShareGPT" in meta["source"]
