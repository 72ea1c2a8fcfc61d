"""The exact-distribution check every sampling path must pass (the tests' and the GPU check's one copy).

Enumerate all V^L continuations of a prompt under the target's processed distribution, sample many
generations from the method under test, and compare by a Pearson chi-square test at a fixed seed. The
test suites also run it on a deliberately wrong variant to show it can fail."""
import itertools
from collections import Counter

import torch

from ..decoding.sampling import process_logits


def exact_sequence_probs(target, prompt, params, V, L):
    """P(sequence) for all V^L continuations under processed target sampling."""
    probs = {}
    for seqs in itertools.product(range(V), repeat=L):
        p, ids = 1.0, list(prompt)
        for t in seqs:
            target.reset()
            logits, _ = target.forward(torch.tensor(ids, device=target.device), n_logits=1)
            p *= process_logits(logits[0], params)[t].item()
            ids.append(t)
        probs[seqs] = p
    return probs


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    assert not any(counts.get(c, 0) and probs[c] == 0 for c in probs), "sampled an impossible sequence"
    stat, df, pool_obs, pool_exp = 0.0, 0, 0.0, 0.0
    for cell, p in probs.items():
        exp, obs = p * n, counts.get(cell, 0)
        if exp < 5:
            pool_obs, pool_exp = pool_obs + obs, pool_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / max(pool_exp, 1e-9)
        df += 1
    df -= 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def sample_counts(dec, prompt, params, policy, n, L):
    """Outputs of n seeded generations of L tokens, counted."""
    return Counter(tuple(dec.generate(prompt, max_new_tokens=L, sampling=params, policy=policy, seed=s).token_ids)
                   for s in range(n))
