"""Integration tests on the real default pair (Qwen2.5-Coder 0.5B draft / 1.5B target).

Marked slow: they need the pair in the cache (`adaptive-spec fetch-models`, run by `make test`).
"""
import pytest
import torch

from adaptive_spec.setup.pair import is_fetched
from adaptive_spec.decoding.auto import Costs

pytestmark = pytest.mark.slow

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain what a hash map is in two sentences."]


@pytest.fixture(scope="module")
def pair():
    if not (is_fetched("draft") and is_fetched("target")):
        pytest.fail("the default pair is not fetched: run `adaptive-spec fetch-models` (make test does)")
    from adaptive_spec import SpecPair

    torch.set_num_threads(2)
    # fp32: a K+1-token verify pass and a 1-token decode step use different kernels, and in
    # bf16 their logits can differ by one bf16 step, enough to flip an exact near-tie argmax.
    # The algorithm is exact; the test checks it where rounding cannot decide the outcome.
    pair = SpecPair.load(dtype="fp32", device="cpu")
    pair.pinned_costs = FIXED_COSTS
    return pair


# What `--k auto` prices copies with, fixed: the output is the target's whatever K a round takes, and measuring
# this machine's costs (passes of up to 48 rows after a 256-token context) took minutes of the suite on AVX2.
# A torch-like table: multi-row passes cost little more than one row, so copies pay and get verified.
FIXED_COSTS = Costs(0.03, 0.1, 0.0, "fixed", "tests", tuple(0.1 * v for v in (1, 1.02, 1.04, 1.06, 1.08, 1.1, 1.15,
                                                                              1.2, 1.25)),
                    t_verify_long={n: 0.1 * v for n, v in ((12, 1.4), (16, 1.6), (24, 2.0), (32, 2.4), (48, 3.2))})


def test_pair_shares_vocabulary(pair):
    assert pair.target.vocab_size == pair.draft.vocab_size == 151936
    assert pair.draft.hidden_size == 896 and pair.target.hidden_size == 1536


@pytest.fixture(scope="module")
def target_alone(pair):
    """The target's greedy output per (prompt, length), generated once for the module's tests."""
    memo = {}

    def generate(prompt, max_new_tokens):
        if (prompt, max_new_tokens) not in memo:
            memo[prompt, max_new_tokens] = pair.generate(prompt, policy="ar", temperature=0,
                                                         max_new_tokens=max_new_tokens, chat=True)
        return memo[prompt, max_new_tokens]
    return generate


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_greedy_target(pair, target_alone, prompt):
    ref = target_alone(prompt, 48)
    spec = pair.generate(prompt, policy="fixed", k=4, temperature=0, max_new_tokens=48, chat=True)
    assert spec.token_ids == ref.token_ids, (ref.text, spec.text)
    # a coder pair agrees on most tokens: far fewer target passes than tokens
    assert spec.metrics.verification_rate < 0.6


EDIT = ("Add type hints to this function and reply with the whole function:\n\n"
        "def mean(numbers):\n    total = 0\n    for x in numbers:\n        total += x\n    return total / len(numbers)\n")


@pytest.mark.parametrize("k", ["auto", 3])
def test_greedy_prompt_lookup_equals_greedy_target(pair, target_alone, k):
    """Copied drafts on the real pair (torch, fp32): the same greedy output as the target alone, with copies
    drafted and accepted on an edit request."""
    ref = target_alone(EDIT, 64)
    spec = pair.generate(EDIT, policy="ngram", k=k, temperature=0, max_new_tokens=64, chat=True)
    assert spec.token_ids == ref.token_ids, (ref.text, spec.text)
    assert spec.metrics.by_source.n_accepted_by.get("ngram", 0) > 0
