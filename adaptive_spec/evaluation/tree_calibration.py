"""The 0-th order acceptance model of tree policies: what it predicts from rates measured once and frozen.

Tree policies choose their shape from the conditional acceptance rates c_i per sibling index
(shapes.PositionalRates). Measured on the prompts being evaluated, or adapted while they run, the rates
would make each output depend on what ran before; so, as in the ERSD paper, they are measured once on
separate calibration prompts (batch drafting of `width` siblings, which samples the later sibling
indices, plus sequence drafting: sweep_calibration.measure_rates) and then passed frozen to every run."""
from __future__ import annotations

from ..decoding.trees.shapes import acceptance_distribution, shape_tree, tree_value, tunstall_bound

# the tree and multi-draft policies of sweeps and reports, and the verification whose rates each
# tree policy is calibrated with (spectr / batch-sd draw i.i.d. drafts: no rates)
TREE_POLICIES = ("tree", "ersd", "spectr", "batch-sd")
VERIFICATION = {"tree": "gsd", "ersd": "ersd"}


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
