"""Second-turn prompts: a first request, the target's own answer to it, and a follow-up that asks to
revise or extend that answer (prompts.FOLLOWUPS), as a JSONL of conversations a sweep reads.

Much of a revised answer repeats the first one, which is what prompt-lookup drafting copies from
(decoding/ngram.py); these are the chats where users see that. The first answers are the target's
greedy continuations on the llama.cpp engine (the fetched GGUF), made once: a rerun keeps the rows it
has and adds the rest (resumable, one line per conversation, fsynced).

    python eval/make_followups.py --datasets humaneval,gsm8k,alpaca --prompts 10 --out runs/prompts/followups.jsonl
    adaptive-spec sweep --config configs/sweep/ngram_llama_cpp.yaml   # reads it as datasets: [runs/prompts/followups.jsonl]
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from adaptive_spec.decoding.pipeline import SpecPair
from adaptive_spec.errors import run_main
from adaptive_spec.prompts import followup_messages, load_prompts
from adaptive_spec.runs import append_jsonl, project_path, read_jsonl


def _main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="humaneval,gsm8k,alpaca", help="first requests from these prompt sets")
    ap.add_argument("--prompts", type=int, default=10, help="conversations per set")
    ap.add_argument("--first-tokens", type=int, default=160, help="length of the first answer (greedy)")
    ap.add_argument("--seed", type=int, default=1, help="prompt shuffle seed (the sweeps use 0: other prompts)")
    ap.add_argument("--out", default="runs/prompts/followups.jsonl")
    args = ap.parse_args(argv)
    out = project_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["dataset"], r["prompt_idx"]) for r in read_jsonl(out, repair=True)}
    todo = [(ds, i, p, d + i) for d, ds in enumerate(args.datasets.split(","))
            for i, p in enumerate(load_prompts(ds, n=args.prompts, seed=args.seed)) if (ds, i) not in done]
    if not todo:
        print(f"{out}: complete")
        return 0
    pair = SpecPair.load(backend="llama.cpp", draft=None)
    for ds, i, prompt, which in tqdm(todo, desc="first answers", file=sys.stderr):
        first = pair.generate(prompt, policy="ar", temperature=0, max_new_tokens=args.first_tokens, chat=True)
        append_jsonl(out, {"dataset": ds, "prompt_idx": i, "messages": followup_messages(prompt, first.text, which)})
    print(f"{out}: {len(done) + len(todo)} conversations")
    return 0


def main(argv=None) -> int:
    return run_main(_main, argv, "finished conversations are kept; rerun the same command to add the rest")


if __name__ == "__main__":
    sys.exit(main())
