"""Acceptance on a user's own prompts (`probe --prompts`, `generate --auto-prompts`): the committed curve counts
the heads' dev answers, so the loaded pair records a few short answers on the user's prompts as datagen
records them (along the target's X: a candidate Y_i ~ q_i, P_i = min(1, p_i(Y_i) / q_i(Y_i)) and the head's
p̂), time-boxed by `budget_s`; their curve goes to a cache file, read as `--curve` is."""
from __future__ import annotations

import json
import time

from ...errors import UserError

# the recording's share of the probe's time: loading the pair and timing its forwards take the rest
BUDGET_S = 40.0
MAX_PROMPTS = 16  # prompts taken from a set (shuffled as load_prompts shuffles), enough for the budget
PROMPT_TOKENS = 64  # tokens an answer: more answers in the budget rather than longer ones
FIELD = "prompt"


def load_texts(spec) -> tuple[list, str]:
    """(prompt texts, a label) of --prompts / --auto-prompts: a known set's name, a slice of one (SET:START:STOP,
    in file order, either end may be empty), or a .json/.jsonl file whose records have a `prompt` field; at most
    MAX_PROMPTS (a set's shuffled). Refused before a model loads."""
    from ...prompts import BUILTIN, known_names, load_prompts, resolve_path

    name = str(spec or "").strip()
    usage = (f"pass a .jsonl file with a {FIELD!r} field on each line, or one of the prompt sets {known_names()} "
             "(a slice of one as SET:START:STOP)")
    if name in BUILTIN:
        return load_prompts(name, n=MAX_PROMPTS), name
    if name.split(":")[0] in BUILTIN and name.count(":") == 2:
        return _set_slice(name, usage), name
    path = resolve_path(name) if name else None
    if path is None:
        raise UserError(f"--prompts {name!r}: no such file and no such prompt set; {usage}")
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
            if path.suffix == ".jsonl" else json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: not JSON lines ({str(e).splitlines()[0]}); {usage}") from None
    texts = [r[FIELD] for r in (rows if isinstance(rows, list) else []) if isinstance(r, dict)
             and isinstance(r.get(FIELD), str) and r[FIELD].strip()]
    if not texts:
        raise UserError(f"--prompts {path}: no record with a non-empty {FIELD!r} field; {usage}")
    return texts[:MAX_PROMPTS], str(path)


def _set_slice(name: str, usage: str) -> list:
    """SET:START:STOP: the set's prompts [START:STOP] in file order, shuffled as load_prompts shuffles a set,
    the first MAX_PROMPTS."""
    import random

    from ...prompts import prompt_texts

    base, *ends = name.split(":")
    try:
        start, stop = (int(e) if e.strip() else None for e in ends)
    except ValueError:
        raise UserError(f"--prompts {name!r}: START and STOP of SET:START:STOP are prompt indices (either may be "
                        f"empty); {usage}") from None
    every = prompt_texts(base)
    texts = every[start:stop]
    if not texts:
        raise UserError(f"--prompts {name!r}: the slice holds no prompt ({base} has {len(every)}); {usage}")
    random.Random(0).shuffle(texts)
    return texts[:MAX_PROMPTS]


def record(pair, prompts: list[list[int]], head=None, temperature: float = 1.0, max_new_tokens: int = PROMPT_TOKENS,
           budget_s: float = BUDGET_S) -> list[dict]:
    """Per prompt (token ids), along the target's answer X: x, y, P and p̂ (the last two None without a draft;
    p̂ None without a head). Stops at the first token past `budget_s` seconds (an answer cut there is kept)."""
    import torch

    from ...typed import SamplingParams

    gen = torch.Generator().manual_seed(0)
    s = getattr(head, "stats_params", None)  # the probe's temperature, truncated as the head's data was
    sampling = SamplingParams(temperature, s.top_k if s is not None else 50, s.top_p if s is not None else 1.0)
    deadline = time.perf_counter() + budget_s
    out = []
    with torch.inference_mode():
        for ids in prompts:
            if time.perf_counter() > deadline:
                break
            out.append(_answer(pair, ids, head, sampling, max_new_tokens, deadline, gen))
    return [r for r in out if r["x"]]


def _answer(pair, ids, head, sampling, max_new_tokens, deadline, gen) -> dict:
    import torch

    from ..sampling import process_logits, sample
    from ...heads.features import step_stats
    from ...heads.head import join_inputs, reads_stats

    target, draft = pair.target, pair.draft
    for lm in (target, draft):
        if lm is not None:
            lm.reset()

    def feed(lm, tokens):  # runners take ids as a tensor on their device
        return lm.forward(torch.tensor(tokens, dtype=torch.long, device=lm.device))

    def probs(logits):
        return process_logits(logits[-1].float(), sampling)

    t_logits = feed(target, ids)[0]
    d_logits, d_hidden = feed(draft, ids) if draft is not None else (None, None)
    stats_params = getattr(head, "stats_params", None) if reads_stats(getattr(head, "inputs", "hidden")) else None
    rec = {"prompt": list(ids), "x": [], "y": [], "P": [], "phat": []}
    while len(rec["x"]) < max_new_tokens and time.perf_counter() <= deadline:
        p = probs(t_logits)
        x = int(sample(p, gen))
        if draft is not None:
            q = probs(d_logits)
            y = int(sample(q, gen))
            rec["y"].append(y)
            rec["P"].append(min(1.0, float(p[y]) / float(q[y])))
            if head is not None:
                state = d_hidden
                if getattr(head, "feature", "token") == "token":  # the state at Y_i's own position, then undone
                    state = feed(draft, [y])[1]
                    draft.rollback(draft.length - 1)
                stats = None if stats_params is None else step_stats(d_logits[-1], torch.tensor(y), stats_params)
                rec["phat"].append(float(head.acceptance_prob(join_inputs(state, stats))))
        rec["x"].append(x)
        if x in pair.eos_token_ids:
            break
        t_logits = feed(target, [x])[0]
        if draft is not None:
            d_logits, d_hidden = feed(draft, [x])
    return rec


def as_responses(records: list[dict]) -> list[tuple]:
    """The records as autotune.responses yields a datagen split's: (source, P, p̂, prompt ids, response ids)."""
    import numpy as np

    return [(None, np.asarray(r["P"] or [], dtype=np.float64), np.asarray(r["phat"]) if r.get("phat") else None,
             r["prompt"], r["x"]) for r in records]


def curve(records: list[dict], head, head_dir, label: str, temperature: float, k_max: int = 20) -> dict | None:
    """The threshold curve of the records (autotune.curve_of; None without a draft's records), with what
    load_curve checks (the head's weights) and where it came from."""
    from ...heads.curve import weights_hash
    from .curve_replay import curve_of

    if not any(r["P"] for r in records):
        return None
    lag = 0 if getattr(head, "feature", "token") == "context" else 1
    out = curve_of(as_responses(records), lag, k_max, head is not None)
    out.update(head=None if head is None else {"path": str(head_dir), "feature": getattr(head, "feature", "token"),
                                               "inputs": getattr(head, "inputs", "hidden"),
                                               "weights": weights_hash(head_dir)},
               data={"prompts": label, "sampling": {"temperature": temperature}},
               command=f"adaptive-spec probe --prompts {label}", records=records)
    return out


def measure_prompts(pair, texts: tuple[list, str], head_dir, temperature: float = 1.0, budget_s: float = BUDGET_S,
                    cache: bool = True, k_max: int = 20) -> dict:
    """Record on `texts` (load_texts' prompts and label) and cache their curve: {"label", "n_prompts", "n_tokens",
    "curve_file" (None without a draft), "records"}; the same pair, head, prompts and temperature read the file
    (cache=False: record afresh, write nothing). `k_max`: the curve's cap on candidates a round."""
    from .costs import config_key, cost_config, costs_dir
    from ...heads import head as heads
    from ...heads.curve import weights_hash

    texts, label = texts
    ids = [pair.encode(t, chat=bool(getattr(pair.tokenizer, "chat_template", None))) for t in texts]
    head = None
    if head_dir is not None and pair.draft is not None:
        head = heads.load_head(head_dir, why="the probe's --prompts", inputs=heads.INPUTS)
    key = config_key({"pair": cost_config(pair), "prompts": ids, "temperature": temperature,
                      "head": None if head is None else [str(head_dir), weights_hash(head_dir)],
                      **({} if k_max == 20 else {"k_max": k_max})})  # keys of the default cap stay as they were
    path = costs_dir().parent / "prompt_curves" / f"{key}.json"
    if cache and path.is_file():
        saved = json.loads(path.read_text())
        return _summary(label, saved["records"], path if saved.get("format") else None)
    records = record(pair, ids, head, temperature, budget_s=budget_s)
    if not records:
        raise UserError(f"--prompts {label}: no answer was generated within --prompts-budget-s {budget_s:g}; "
                        "raise the budget")
    made = curve(records, head, head_dir, label, temperature, k_max) if pair.draft is not None else None
    if cache:
        from ...runs import write_json

        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, made or {"records": records})
    return _summary(label, records, path if cache and made else None)


def _summary(label: str, records: list[dict], curve_file) -> dict:
    return {"label": label, "n_prompts": len(records), "n_tokens": sum(len(r["x"]) for r in records),
            "curve_file": None if curve_file is None else str(curve_file), "records": records}


def describe(measured: dict | None) -> str:
    """Which acceptance priced the configurations, in words."""
    if measured is None:
        return "the dev answers"
    return f"your prompts ({measured['n_prompts']} prompts, {measured['n_tokens']} tokens: {measured['label']})"
