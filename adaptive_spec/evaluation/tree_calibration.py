"""The 0-th order acceptance model of tree policies: measured once, frozen, and what it predicts.

Tree policies choose their shape from the conditional acceptance rates c_i per sibling index
(shapes.PositionalRates). Measured on the prompts being evaluated, or adapted while they run, the rates
would make each output depend on what ran before; so, as in the ERSD paper, they are measured once on
separate calibration prompts (batch drafting of `width` siblings, which samples the later sibling
indices, plus sequence drafting) and then passed frozen to every run."""
from __future__ import annotations

import sys

from tqdm import tqdm

from ..decoding.trees.policy import TreePolicy
from ..decoding.trees.shapes import (PositionalRates, acceptance_distribution, shape_tree, tree_value,
                                     tunstall_bound)

# the tree and multi-draft policies of sweeps and reports, and the verification whose rates each
# tree policy is calibrated with (spectr / batch-sd draw i.i.d. drafts: no rates)
TREE_POLICIES = ("tree", "ersd", "spectr", "batch-sd")
VERIFICATION = {"tree": "gsd", "ersd": "ersd"}
CALIBRATION_RUNS = (("batch", None), ("sequence", 4))  # (drafting, budget); None: the calibration width
CALIBRATION_SEED = 10_000  # far from the evaluation seeds, so no calibration run repeats an evaluated one


def measure_rates(pair, prompts: list[list[int]], sampling, max_new_tokens: int, method: str = "gsd",
                  width: int = 8, seed: int = CALIBRATION_SEED, progress: bool = False) -> dict:
    """{"cond_rates", "trials", "hits"} of verification `method` (gsd | ersd) over the token-id
    prompts: every run adapts one shared estimate (weight 1 prior, i.e. the data dominates)."""
    est = PositionalRates(weight=1.0, adapt=True, method=method)
    runs = [(i, d, k or width) for i in range(len(prompts)) for d, k in CALIBRATION_RUNS]
    bar = tqdm(runs, desc=f"calibrate {method}", unit="run", dynamic_ncols=True, disable=not progress,
               file=sys.stderr)
    for i, drafting, k in bar:
        # carry_rates: the shared estimate must keep what each run adds, not restore it per generation
        pol = TreePolicy(method, drafting, k, rates=est, carry_rates=True)
        pair.decoder.generate(prompts[i], max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                              seed=seed + i)
        bar.set_postfix_str(f"c0={est.cond()[0]:.3f}")
    return est.to_dict()


def _dist(cond, k: int, vocab_size: int | None = None) -> list[float]:
    # as TreePolicy: a vertex has at most min(k, V) children
    return acceptance_distribution(cond, min(k, vocab_size) if vocab_size else k)


def zeroth_order_accepted(cond, drafting: str, k: int, vocab_size: int | None = None) -> float:
    """Expected accepted tokens per round, sum of R over the drafted nodes, of the `drafting`
    shape with k drafted tokens under the 0-th order model of the rates `cond`."""
    r = _dist(cond, k, vocab_size)
    return tree_value(*shape_tree(drafting, k, r, max_children=vocab_size), r)


def tunstall_accepted(cond, k: int, vocab_size: int) -> float:
    """Upper bound on the expected ACCEPTED tokens per target pass of any k-token tree under the
    rates `cond`: the Tunstall bound on generated tokens (ERSD Theorem 4.1 / Lemma 4.2) minus the
    one token the target draws."""
    return tunstall_bound(_dist(cond, k, vocab_size), k, vocab_size) - 1.0
