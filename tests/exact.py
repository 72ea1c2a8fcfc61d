"""The exact-distribution check every sampling path must pass: enumerate all continuations, sample, compare
by chi-square (adaptive_spec/evaluation/exactness.py, shared with eval/gpu_check.py)."""
from adaptive_spec.evaluation.exactness import chi_square_pvalue, exact_sequence_probs, sample_counts  # noqa: F401
