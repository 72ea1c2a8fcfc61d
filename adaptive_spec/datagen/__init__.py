"""Data generation: target responses, draft distributions and per-token acceptance targets with
token mixing (`adaptive-spec datagen`), and the draft features derived afterwards."""
