"""The fused decoder (backends/fused.py, static_runner.FusedCausalLM) on tiny random Qwen2 and Llama models,
CPU, fp32.

Same logits and hidden states as the Hugging Face modules (prefill, one-row steps, verify passes, after
rollbacks; GQA and MHA, biases, tied embeddings, a padded output layer, a reduced draft vocabulary, scaled
RoPE), exact speculative decoding through it (greedy token for token, sampling seed for seed, a chi-square
test of the sampled distribution, and that test failing on a runner whose mask shows later candidates or
whose rollback forgets the position), the tree hooks, what it refuses, the ops a step dispatches (bounded
per layer, so a change that adds launches fails here; attention one fused kernel, never the math fallback;
K and V one buffer, one write), a cache length off the mask's alignment, no host read inside a step, and
dynamo tracing the step whole.
"""
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from adaptive_spec.backends.fused import FusedDecoder, OpCounter, step_launches, unsupported_reason
from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.backends.static_runner import (DRAFT_SHAPES, FusedCausalLM, StaticCausalLM, make_runner,
                                                  verify_shapes)
from adaptive_spec.backends.vocab import reduce_output_layer
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.interfaces import PolicyContext
from adaptive_spec.decoding.pipeline import make_policy
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead
from test_decoding import L, V, chi_square_pvalue, exact_sequence_probs, sample_counts
from tiny import make_model

GREEDY = SamplingParams(temperature=0)
ARCHS = ("qwen2", "llama")

# per decoder layer, one eager one-token step: rms_norm x2, qkv and gate_up linear, bmm (RoPE, v through
# the identity), index_copy_ (K and V at once), scaled_dot_product_attention, addmm x2 (o, down + residual),
# silu, mul
FUSED_OPS_PER_LAYER = 11
FUSED_OPS_PER_LAYER_VERIFY = 11  # n > 1: every reshape stays a view
# embedding, positions, mask (gt, where), rotations (index_select, mul, addcmul, cat), final norm, LM head,
# pos update
FUSED_OPS_PER_STEP = 11


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def hf_model(arch="qwen2", seed=0, vocab=32, hidden=32, heads=4, kv_heads=2, layers=2, **cfg):
    """A random model with the config's knobs reachable (make_model fixes 2 heads / 1 kv head)."""
    torch.manual_seed(seed)
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    conf = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                   bos_token_id=3, eos_token_id=1, pad_token_id=0, **{"tie_word_embeddings": False, **cfg})
    model = model_cls(conf).float().eval()
    with torch.no_grad():  # random biases and norms: zeros and ones would hide a misplaced one
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


def compare_with_hf(model, vocab_size=None, max_cache_len=40):
    """Prefill, a verify pass, a step, rollbacks into the middle of a pass and past the prompt, reset:
    the fused runner's logits and hidden states against CausalLM's on the same prefix."""
    lm = FusedCausalLM(model, vocab_size, max_cache_len=max_cache_len)
    vocab = vocab_size or model.config.vocab_size

    def ref(prefix, n_logits):
        return CausalLM(model, vocab_size).forward(torch.tensor(prefix), n_logits)

    seq = [5, 9, 4, 17, 8, 6, 11, 12, 20, 3, 7, 7]
    assert lm.forward(torch.tensor(seq[:4]), 0)[0].shape == (0, vocab)
    fed = seq[:4]
    for chunk, n_logits, back in ((seq[4:9], 5, 6), (seq[9:10], 1, None), ([25, 3], 2, 3), ([30], 1, 0),
                                  (seq[:7], 3, None), (seq[7:12], 1, None)):
        got, h_got = lm.forward(torch.tensor(chunk), n_logits)
        fed = fed + chunk
        want, h_want = ref(fed, n_logits)
        assert got.dtype == torch.float32 and got.shape == (n_logits, vocab)
        close(got, want)
        close(h_got, h_want)
        assert lm.length == len(fed)
        if back is not None:
            lm.rollback(back)
            fed = fed[:back]
            assert int(lm._pos) == lm.length == back
    lm.reset()
    close(lm.forward(torch.tensor([1, 2]), 2)[0], ref([1, 2], 2)[0])
    return lm


@pytest.mark.parametrize("arch", ARCHS)
def test_same_numbers_as_hugging_face(arch):
    lm = compare_with_hf(hf_model(arch))  # GQA: 4 q heads on 2 kv heads
    assert lm.fused and lm.counters.n_forwards == 8 and lm.max_length == 40


def test_a_cache_length_off_the_mask_alignment(monkeypatch):
    """37 slots: the mask's rows are padded to 40 elements (what the CUDA attention kernel reads without a
    copy) and sliced back, in the step's mask and in a tree pass's; the numbers stay Hugging Face's."""
    lm = compare_with_hf(hf_model("llama"), max_cache_len=37)
    mask = lm.decoder.causal_mask(torch.tensor([3, 4]))
    assert mask.shape == (2, 37) and mask.stride() == (40, 1)
    assert torch.equal(mask == 0, torch.arange(37) <= torch.tensor([[3], [4]]))
    seen, real = [], F.scaled_dot_product_attention

    def spy(*args, attn_mask, **kw):
        seen.append(attn_mask)
        return real(*args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lm.tree_forward(torch.tensor([3, 4]), torch.tensor([2, 3]), torch.ones(2, 4, dtype=torch.bool))
    assert len(seen) == 2 and all(m.stride() == (40, 1) for m in seen)  # a tree mask's rows are 37 apart
    assert torch.equal(seen[0][:, :4], torch.zeros(2, 4)) and (seen[0][:, 4:] < -1e30).all()


def test_keys_and_values_share_one_buffer_per_layer():
    """A layer's K and V are the two halves of one [2, kv_heads, slots, head_dim] buffer (one write per
    step), and the runner's kv buffers (compact, kv_bytes_per_slot) are views of it."""
    lm = FusedCausalLM(hf_model(), max_cache_len=16)
    lm.forward(torch.tensor([5, 9, 4]), 1)
    for (k, v), kv in zip(lm._kv_buffers(), lm.decoder.kv_cache):
        assert kv.shape == (2, 2, 16, 8) and k.shape == v.shape == (1, 2, 16, 8)
        assert k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv[1].data_ptr()
        assert kv[:, :, :3].abs().sum(-1).gt(0).all() and kv[:, :, 3:].eq(0).all()  # slots 0..2 written
    assert lm.kv_bytes_per_slot == 2 * 2 * 2 * 8 * 4  # layers x (K, V) x kv_heads x head_dim x fp32


@pytest.mark.parametrize("arch,cfg", [
    ("llama", dict(kv_heads=4)),  # plain multi-head attention
    ("llama", dict(attention_bias=True, mlp_bias=True)),  # a bias on every projection
    ("qwen2", dict(tie_word_embeddings=True)),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16})),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 32})),
], ids=["mha", "biases", "tied", "rope-linear", "rope-llama3", "rope-yarn"])
def test_same_numbers_across_configs(arch, cfg):
    compare_with_hf(hf_model(arch, **cfg))


def test_padded_output_layer_is_cut_to_the_shared_vocabulary():
    """A target whose output layer has more rows than the tokenizer (Qwen2.5 7B: 152,064 vs 151,936):
    the runner's vocab_size keeps the shared ones."""
    model = hf_model(vocab=40, tie_word_embeddings=True)
    compare_with_hf(model, vocab_size=32)


def test_a_reduced_draft_vocabulary_spreads_its_logits():
    """A draft whose output layer keeps some tokens only (vocab.py): -inf elsewhere, as CausalLM."""
    model = hf_model()
    reduce_output_layer(model, torch.tensor([0, 1, 5, 9, 17, 30]))
    lm = compare_with_hf(model)
    logits, _ = lm.forward(torch.tensor([4]), 1)
    assert torch.isinf(logits[0, 2]) and torch.isfinite(logits[0, 9])


def test_weights_are_shared_not_copied():
    model = hf_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lm = FusedCausalLM(model, max_cache_len=16)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv, gate_up = lm.decoder.layers[1].qkv, lm.decoder.layers[1].gate_up
    assert attn.k_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert lm.decoder.layers[1].qkv_b.shape == (qkv.shape[0],)  # q, k and v biases, one vector
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model computes what it did


def test_unsupported_models_are_refused_before_any_weight_moves():
    model = hf_model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UserError, match="rope types default, linear, llama3, yarn, not 'dynamic'"):
        FusedCausalLM(model)
    gelu = hf_model("llama", hidden_act="gelu")
    assert "hidden_act='gelu'" in unsupported_reason(gelu)
    other = hf_model()
    other.config.model_type = "mistral"
    with pytest.raises(UserError, match="qwen2 and llama models, not 'mistral'"):
        FusedCausalLM(other)
    packed = hf_model()

    class Packed(torch.nn.Linear):  # a packed or quantized layer: no plain weight to concatenate
        pass

    old = packed.model.layers[1].mlp.up_proj
    packed.model.layers[1].mlp.up_proj = Packed(old.in_features, old.out_features, bias=False)
    ptr = packed.model.layers[0].self_attn.q_proj.weight.data_ptr()
    with pytest.raises(UserError, match="plain nn.Linear projections \\(layer 1 has Packed\\)"):
        FusedCausalLM(packed)
    assert packed.model.layers[0].self_attn.q_proj.weight.data_ptr() == ptr  # untouched
    sliding = hf_model(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(UserError, match="full-attention"):
        FusedCausalLM(sliding)


def test_make_runner_builds_it():
    model = hf_model()
    lm = make_runner(model, kv_cache="static", max_cache_len=16, warmup_shapes=DRAFT_SHAPES, fused=True)
    assert type(lm) is FusedCausalLM and lm.runtime == "eager" and lm.length == 0 and lm.counters.n_forwards == 0
    assert type(make_runner(model, kv_cache="static", max_cache_len=16)) is StaticCausalLM
    with pytest.raises(UserError, match="the fused decoder needs the static KV cache: add --kv-cache static"):
        make_runner(model, fused=True)
    with pytest.raises(UserError, match="CUDA"):
        make_runner(model, kv_cache="static", runtime="cudagraph", fused=True)  # CPU here


# ---- exact speculative decoding through fused runners --------------------------------------------

@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    """(draft, target) of one architecture: different sizes and seeds, sharp distributions."""
    arch = request.param
    return (make_model(32, hidden_size=16, layers=2, seed=1, arch=arch, logit_scale=4.0),
            make_model(32, hidden_size=24, layers=3, seed=2, arch=arch, logit_scale=4.0))


def greedy_speculative_against_target(runner, draft, target, k: int):
    """(fixed-K greedy speculative decoding with both models on `runner` (a runner class), the target's own greedy
    tokens on the dynamic runner): the two must be equal token for token (test_static_runner.py uses it too)."""
    prompt = [5, 9, 4, 17]
    ref = Decoder(CausalLM(target)).generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    dec = Decoder(runner(target, max_cache_len=64), runner(draft, max_cache_len=64))
    return dec.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=FixedK(k)), ref


def assert_sampling_matches_dynamic_runner(runner, draft, target):
    """Same models, same seed: `runner` (warmed up, a no-op without a graph runtime) and the dynamic runner draw
    the same tokens (their logits agree to float rounding)."""
    t, d = runner(target, max_cache_len=64), runner(draft, max_cache_len=64)
    t.warmup(verify_shapes(3))
    d.warmup(DRAFT_SHAPES)
    fast, dyn = Decoder(t, d), Decoder(CausalLM(target), CausalLM(draft))
    for seed in range(3):
        a = fast.generate([5, 9, 4], 25, SamplingParams(1.0), FixedK(3), seed=seed).token_ids
        assert a == dyn.generate([5, 9, 4], 25, SamplingParams(1.0), FixedK(3), seed=seed).token_ids


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_greedy_target(pair, k):
    g, ref = greedy_speculative_against_target(FusedCausalLM, *pair, k)
    assert g.token_ids == ref
    assert g.metrics.n_draft_forwards == g.metrics.n_drafted and g.metrics.n_discarded > 0  # rollbacks ran


def test_sampling_matches_dynamic_runner_seed_for_seed(pair):
    assert_sampling_matches_dynamic_runner(FusedCausalLM, *pair)


def context_model(seed):
    """A one-layer model whose next token depends on its context: Hugging Face's 0.02 init makes a tiny
    model nearly a bigram table, blind to a wrong mask or position; attention and embeddings scaled up
    (and sharper logits) make the chi-square test below see such bugs."""
    model = make_model(V, hidden_size=16, layers=1, seed=seed, logit_scale=10.0)
    with torch.no_grad():
        for p in (*model.model.layers[0].self_attn.parameters(), model.model.embed_tokens.weight):
            p.mul_(30.0)
    return FusedCausalLM(model, max_cache_len=16)


N_EXACT = 1500


def test_distribution_is_exact_through_fused_runners():
    target, draft = context_model(3), context_model(4)
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    assert len(probs) == V ** L
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), n=N_EXACT)
    assert chi_square_pvalue(counts, probs, N_EXACT) > 1e-3


def leaky_mask(self, positions):  # every row of a pass sees the whole pass
    return torch.where(self.slots > positions[-1], self.fill[0], self.fill[1]).expand(len(positions), -1)


def forgetful_rollback(self, length):  # length moves, the position scalar does not
    self.length = min(self.length, length)


@pytest.mark.parametrize("cls,name,bug", [(FusedDecoder, "causal_mask", leaky_mask),
                                          (FusedCausalLM, "rollback", forgetful_rollback)],
                         ids=["mask-shows-later-candidates", "rollback-keeps-position"])
def test_distribution_test_catches_a_broken_runner(monkeypatch, cls, name, bug):
    """The same check must fail on a fused runner whose mask lets a verify row see the candidates after
    it, or whose rollback leaves rejected candidates visible and later positions shifted. The reference
    resets the runner before each prefix and reads the last row of a one-layer model only, so it is
    blind to both: only the speculative decode sees them."""
    target, draft = context_model(3), context_model(4)
    params, prompt = SamplingParams(1.0), [1, 2]
    probs = exact_sequence_probs(target, prompt, params)
    monkeypatch.setattr(cls, name, bug)
    assert exact_sequence_probs(target, prompt, params) == probs
    counts = sample_counts(Decoder(target, draft), prompt, params, FixedK(2), n=N_EXACT)
    assert chi_square_pvalue(counts, probs, N_EXACT) < 1e-3


# ---- the tree contract ---------------------------------------------------------------------------

@pytest.mark.parametrize("max_cache_len", [32, 37])  # 37: a tree mask whose rows the decoder realigns
@torch.inference_mode()
def test_tree_forward_and_compact_match_the_dynamic_runner(max_cache_len):
    model = hf_model()
    lm, ref = FusedCausalLM(model, max_cache_len=max_cache_len), CausalLM(model)
    seq = torch.tensor([5, 9, 4, 17, 8])
    for r in (lm, ref):
        r.forward(seq, n_logits=0)
    # a root with two children, the first with a child: slots 5..8, positions 5, 6, 6, 7
    ids, positions = torch.tensor([3, 11, 12, 20]), torch.tensor([5, 6, 6, 7])
    attend = torch.zeros(4, 9, dtype=torch.bool)
    attend[:, :5] = True
    for row, ancestors in enumerate(([5], [5, 6], [5, 7], [5, 6, 8])):
        attend[row, ancestors] = True
    a, ha = lm.tree_forward(ids, positions, attend, logit_from=1)
    b, hb = ref.tree_forward(ids, positions, attend, logit_from=1)
    assert a.shape == (3, 32) and ha.shape == (4, 32)
    close(a, b)
    close(ha, hb)
    lm.compact(5, [5, 6, 8])  # keep the path root -> first child -> its child
    assert lm.length == 8 and int(lm._pos) == 8
    got, _ = lm.forward(torch.tensor([7]), 1)
    want, _ = CausalLM(model).forward(torch.tensor([5, 9, 4, 17, 8, 3, 11, 20, 7]), 1)
    close(got, want)


def test_tree_policy_greedy_equals_target(pair):
    draft, target = pair
    prompt = [5, 9, 4, 17]
    ref = Decoder(CausalLM(target)).generate(prompt, max_new_tokens=30, sampling=GREEDY).token_ids
    dec = Decoder(FusedCausalLM(target, max_cache_len=64), FusedCausalLM(draft, max_cache_len=64))
    for settings in (dict(tree_budget=5), dict(tree_budget=4, drafting="specinfer")):
        pol = make_policy("tree", PolicyContext(), **settings)
        assert dec.generate(prompt, max_new_tokens=30, sampling=GREEDY, policy=pol).token_ids == ref


# ---- launches: ops per step, host reads, graph tracing -------------------------------------------

def step_ops(cls, layers: int, n: int = 1) -> dict:
    lm = cls(hf_model(layers=layers), max_cache_len=32)
    lm.forward(torch.arange(5), n_logits=0)
    out = step_launches(lm, n=n, n_logits=n)
    assert lm.length == 5 and lm.counters.n_forwards == 1  # rolled back, counters restored
    assert out["host_reads"] == 0 and out["cuda_kernels"] is None
    return out


def test_a_step_dispatches_far_fewer_ops_than_the_hugging_face_modules():
    """Ops that do work in one one-token step, per layer (the difference between 4 and 2 layers) and per
    step: the fused decoder stays within its budget, under a third of the Hugging Face modules' (11 vs
    38 with transformers 5.24), attention one op and the K/V write one; a verify pass of 5 tokens within
    its own."""
    fused = {n: step_ops(FusedCausalLM, n) for n in (2, 4)}
    hf = {n: step_ops(StaticCausalLM, n) for n in (2, 4)}
    per_layer = {k: (r[4]["compute_ops"] - r[2]["compute_ops"]) / 2 for k, r in (("fused", fused), ("hf", hf))}
    assert per_layer["fused"] <= FUSED_OPS_PER_LAYER, fused[4]["by_op"]
    layer_ops = {op: (k - fused[2]["by_op"].get(op, 0)) / 2 for op, k in fused[4]["by_op"].items()}
    assert {op: layer_ops.get(op) for op in ("aten.scaled_dot_product_attention", "aten.index_copy_", "aten.bmm",
                                             "aten.rms_norm", "aten.softmax")} == {
        "aten.scaled_dot_product_attention": 1, "aten.index_copy_": 1, "aten.bmm": 1, "aten.rms_norm": 2,
        "aten.softmax": None}, layer_ops
    assert fused[2]["compute_ops"] - 2 * per_layer["fused"] <= FUSED_OPS_PER_STEP, fused[2]["by_op"]
    assert per_layer["hf"] >= 3 * per_layer["fused"], (per_layer, hf[4]["by_op"])
    all_per_layer = {k: (r[4]["aten_ops"] - r[2]["aten_ops"]) / 2 for k, r in (("fused", fused), ("hf", hf))}
    assert all_per_layer["fused"] < all_per_layer["hf"]  # views included
    verify = {n: step_ops(FusedCausalLM, n, n=5)["compute_ops"] for n in (2, 4)}
    assert (verify[4] - verify[2]) / 2 <= FUSED_OPS_PER_LAYER_VERIFY


@torch.inference_mode()
def test_attention_runs_the_fused_kernel_not_the_math_fallback():
    """With a mask and grouped heads, scaled_dot_product_attention must still pick its fused CPU kernel
    (the math fallback is a matmul, softmax and matmul per layer, K/V repeated per q head): one per layer
    in a step, a verify pass and a tree pass, and no copy of K/V, q or the output around it."""
    lm = FusedCausalLM(hf_model(layers=3), max_cache_len=32)  # 4 q heads on 2 kv heads
    lm.forward(torch.arange(5), 0)
    tree = torch.ones(2, 11, dtype=torch.bool)  # after the step and the verify pass: 9 cached + 2
    for run in (lambda: lm.forward(torch.tensor([3]), 1), lambda: lm.forward(torch.tensor([3, 4, 5]), 3),
                lambda: lm.tree_forward(torch.tensor([1, 2]), torch.tensor([9, 10]), tree)):
        with torch.profiler.profile() as prof:
            run()
        names = Counter(e.name for e in prof.events())
        assert names["aten::_scaled_dot_product_flash_attention_for_cpu"] == 3, names
        assert names["aten::_scaled_dot_product_attention_math"] == 0 and names["aten::softmax"] == 0
        inner = [d.name for e in prof.events() if e.name in ("aten::scaled_dot_product_attention", "aten::index_copy_")
                 for d in _descendants(e)]
        assert inner and not {"aten::copy_", "aten::clone", "aten::contiguous"} & set(inner), inner


def _descendants(event):
    return [d for c in event.cpu_children for d in (c, *_descendants(c))]


def assert_no_host_read_inside_a_step(cls, model, hidden: int):
    """Steps of `cls` must be capturable as CUDA graphs: no .item() / bool(tensor) in any shape, the head's
    variant included; after a rollback too; and the head's in-graph output is the head on the step's state."""
    head = AcceptanceHead(hidden, depth=1).eval()
    lm = cls(model, max_cache_len=32, head=head)
    lm.forward(torch.arange(5), n_logits=0)
    with OpCounter() as probe:
        lm.forward(torch.tensor([3]), 1)
        lm.forward(torch.tensor([4, 5]), 1)
        lm.forward(torch.arange(6), 6)
        lm.rollback(7)
        _, h, p = lm.forward_with_head(torch.tensor([6]), 1)
    assert probe.host_reads == [] and probe.ops > 0
    with torch.inference_mode():
        close(p, head.acceptance_prob(h).float())  # the head on the step's own hidden state


def test_no_host_read_inside_a_step():
    assert_no_host_read_inside_a_step(FusedCausalLM, hf_model(), 32)


def compiled_decoding_matches(cls, draft, target):
    """Runners of `cls` compiled with dynamo's 'eager' backend (fullgraph, dynamic=False) decode as the
    dynamic runner does, seed for seed, with K varying and recompiles an error; the head's in-graph output
    equals the head run after. Returns the draft runner."""
    import torch._dynamo

    head = AcceptanceHead(16, depth=1).eval()
    t = cls(target, max_cache_len=64, compile=True, compiler="eager")
    d = cls(draft, max_cache_len=64, compile=True, compiler="eager", head=head)
    t.warmup(verify_shapes(4))
    d.warmup(DRAFT_SHAPES)
    assert t.runtime == "compile" and len(t._warm) == 5 and len(d._warm) == 4
    ref = Decoder(CausalLM(target), CausalLM(draft))
    old = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        for k in range(1, 5):
            a = Decoder(t, d).generate([5, 9, 4], 20, SamplingParams(1.0), FixedK(k), seed=k).token_ids
            assert a == ref.generate([5, 9, 4], 20, SamplingParams(1.0), FixedK(k), seed=k).token_ids
        d.reset()
        d.forward(torch.arange(3), 0)
        _, h, p = d.forward_with_head(torch.tensor([4]), 1)
        with torch.inference_mode():
            close(p, head.acceptance_prob(h).float())
    finally:
        torch._dynamo.config.error_on_recompile = old
    return d


def test_dynamo_traces_the_fused_step_whole_without_recompiles(pair):
    """The fused step traces without a graph break, once per warmed shape, and decoding with K varying
    recompiles nothing. (A few seconds on CPU: no Hugging Face code to trace.)"""
    draft, target = pair
    t0 = time.perf_counter()
    d = compiled_decoding_matches(FusedCausalLM, draft, target)
    # a warmed-up runner's ops are counted on its eager step, not on the compiled call
    plain = FusedCausalLM(draft, max_cache_len=64)
    plain.forward(torch.arange(4), 0)
    assert step_launches(d)["by_op"] == step_launches(plain)["by_op"]
    assert time.perf_counter() - t0 < 60
