"""Speculative decoding: the decoder and exact verification, sampling, the stop policies (fixed K,
SpecDec++, heuristics, the oracle), tree and multi-draft baselines, the `auto` pick and the
time model it prices with, and the SpecPair API."""
