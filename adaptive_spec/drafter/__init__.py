"""The feature drafter (EAGLE): one decoder layer on the target's own hidden states (model.py), its training data
(data.py) and its place in decoding (source.py; on a static KV cache with its step as one graph: static.py over
step.py)."""
