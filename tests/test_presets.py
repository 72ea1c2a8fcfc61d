"""GPU pair presets (backends/presets.py): the real shapes, their tiny variants, and a pair whose target has
padding rows past the shared vocabulary never drafting or emitting them."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from adaptive_spec.backends.runner import CausalLM
from adaptive_spec.backends.presets import PRESETS, TINY_VOCAB, build_model, build_pair, by_hub_ids, preset
from adaptive_spec.backends.static_runner import StaticCausalLM
from adaptive_spec.decoding.decoder import Decoder
from adaptive_spec.decoding.policies import FixedK
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.errors import UserError

# parameter counts the hub's model cards and safetensors indexes give
REAL_PARAMS = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "7B": 7_615_616_512}


def test_presets_have_the_real_shapes():
    assert set(PRESETS) == {"default", "coder-0.5b-7b", "qwen-0.5b-7b", "coder-1.5b-7b", "qwen-1.5b-7b"}
    assert PRESETS["default"].hub_ids == ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    for p in PRESETS.values():
        for s in (p.draft, p.target):
            size = s.hub_id.split("-")[-2]
            assert s.n_params() == REAL_PARAMS[size], s.hub_id
            assert s.tie_word_embeddings == (size != "7B") and s.rope_theta == 1e6 and s.max_positions == 32768
        assert p.vocab_size == 151_936  # the 7B's 152,064 rows: 128 of padding
    assert PRESETS["qwen-0.5b-7b"].target.vocab_rows == 152_064
    assert by_hub_ids("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct").name == "qwen-0.5b-7b"
    assert by_hub_ids("a", "b") is None
    with pytest.raises(UserError, match="unknown pair preset 'nope'; presets: default, coder-0.5b-7b"):
        preset("nope")


@pytest.mark.parametrize("name", list(PRESETS))
def test_tiny_presets_keep_the_structure(name):
    real, tiny = preset(name), preset(name, tiny=True)
    assert tiny.vocab_size == TINY_VOCAB
    for r, t in ((real.draft, tiny.draft), (real.target, tiny.target)):
        assert r.heads // r.kv_heads == t.heads // t.kv_heads and t.tie_word_embeddings == r.tie_word_embeddings
        assert (t.vocab_rows > TINY_VOCAB) == (r.vocab_rows > real.vocab_size)
        model = build_model(t)
        assert sum(x.numel() for x in model.parameters()) == t.n_params()
        assert model.config.vocab_size == t.vocab_rows and model.config.eos_token_id < TINY_VOCAB


def test_the_module_imports_no_torch():
    code = ("import sys, adaptive_spec.backends.presets\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


class Recording(FixedK):
    def __init__(self, k):
        super().__init__(k)
        self.drafted = []

    def should_stop(self, step):
        self.drafted.append(int(step.token))
        return super().should_stop(step)


def padded_pair():
    """The tiny 0.5B/7B pair, its target's padding rows made to win every argmax and most of every
    distribution (a bias of 30 on them): nothing but the vocabulary cut keeps them out."""
    p = preset("coder-0.5b-7b", tiny=True)
    draft, target = build_pair(p)
    old = target.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[p.vocab_size:] = 30.0
    target.lm_head = head
    return p, draft, target


@pytest.mark.parametrize("runner", [CausalLM, StaticCausalLM])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_rows_are_never_drafted_or_emitted(runner, temperature):
    p, draft, target = padded_pair()
    assert target.config.vocab_size > p.vocab_size == draft.config.vocab_size
    # the variant without the cut shows the bias works: the target alone emits padding ids
    alone = Decoder(CausalLM(target)).generate([1, 2, 3], 8, SamplingParams(temperature)).token_ids
    assert all(t >= p.vocab_size for t in alone)
    with pytest.raises(UserError, match="must score the same vocabulary"):
        Decoder(CausalLM(target), CausalLM(draft))
    dec = Decoder(runner(target, p.vocab_size), runner(draft, p.vocab_size))
    for seed in range(3):
        pol = Recording(3)
        out = dec.generate([1, 2, 3], 24, SamplingParams(temperature), pol, seed=seed).token_ids
        assert len(out) == 24 and max(out) < p.vocab_size and max(pol.drafted) < p.vocab_size
