"""Benchmark: tree drafting strategies vs budget (Figure 3 of the ERSD paper, on any pair).

For each drafted-token budget k (default 1, 2, 4, 8, 16, 32), each verification method (GSD =
recursive rejection sampling, ERSD = exponential races) and each drafting strategy
  sequence   a chain of k tokens
  batch      k alternatives for the next token
  specinfer  a SpecInfer-style fixed tree (a trunk of 2, then 3 chains)
  tree       the optimal tree (Algorithm 3) for the measured 0-th order acceptance rates
  tree-head  the optimal tree with R refined per context by an acceptance head (needs --head)
it measures accepted tokens per target pass and tokens/s, and reports what the tree construction
predicted (sum of R over the drafted nodes) and the Tunstall upper bound (Theorem 4.1 / Lemma 4.2)
on generated tokens per pass.

First a calibration run measures the 0-th order conditional acceptance rates c_i per sibling
index (batch drafting of width --calib-width plus sequence drafting, as in the paper) on separate
prompts; then every strategy runs with those rates frozen. Results: <out>/calibration.json,
<out>/results.jsonl (one line per prompt x config; a rerun skips what is done), <out>/summary.json,
<out>/run.json (what the table says beside the rows: the settings, the machine's threads, the
vocabulary the bounds use), <out>/table.md and <out>/accepted_vs_drafted.png.

    python eval/bench_trees.py                                 # the default Qwen pair
    python eval/bench_trees.py --tiny --prompts 2 --max-new-tokens 16 --budgets 1,2,4   # smoke test
    python eval/bench_trees.py --report-only --out eval/results/bench_trees_cpu   # no model: table.md again
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
from adaptive_spec.decoding.trees import policy as T
from adaptive_spec.errors import UserError
from adaptive_spec.evaluation.paired import run_header
from adaptive_spec.runs import append_jsonl, read_json, read_jsonl
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.evaluation.sweep_calibration import load_or_calibrate, measure_rates
from adaptive_spec.evaluation.tree_calibration import tunstall_accepted, zeroth_order_accepted

STRATEGIES = ("sequence", "batch", "specinfer", "tree", "tree-head")
STYLE = {"sequence": ("tab:blue", "o"), "batch": ("tab:orange", "s"), "specinfer": ("tab:green", "^"),
         "tree": ("tab:red", "D"), "tree-head": ("tab:purple", "v")}


def make_tiny_pair(folder: Path) -> tuple[str, str]:
    """Tiny random Qwen2 models sharing a 32-token tokenizer (tests/tiny.py), for smoke tests."""
    from adaptive_spec.backends.toy import save_model

    d, t = folder / "draft", folder / "target"
    if not (d / "config.json").is_file():
        save_model(d, vocab_size=32, hidden_size=16, seed=1, logit_scale=4.0, max_positions=512)
    if not (t / "config.json").is_file():
        save_model(t, vocab_size=32, hidden_size=24, seed=2, logit_scale=4.0, max_positions=512)
    h = folder / "head"
    if not (h / "config.json").is_file():  # a random head, so that the tree-head code path runs too
        from adaptive_spec.heads.head import AcceptanceHead

        torch.manual_seed(0)
        AcceptanceHead(16, depth=1, draft_model=str(d)).save_pretrained(h)
    return str(d), str(t), str(h)


def make_policy(method: str, strategy: str, k: int, rates, head):
    drafting = "tree" if strategy.startswith("tree") else strategy
    return T.TreePolicy(method, drafting, k, "head" if strategy == "tree-head" else "positional", head,
                        rates=list(rates), adapt_rates=False)


def calibrate(pair, prompts, methods, args, path: Path, settings: dict) -> dict:
    """0-th order conditional acceptance rates per method from batch + sequence drafting (reused
    from `path` while the settings hold)."""
    ids = [pair.encode(p, chat=args.chat) for p in prompts]
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    return load_or_calibrate(path, settings, methods, lambda m: measure_rates(
        pair, ids, sampling, args.max_new_tokens, m, args.calib_width, progress=True))


def summarize(rows: list[dict], rates: dict, vocab: int) -> list[dict]:
    by = {}
    for r in rows:
        by.setdefault((r["method"], r["strategy"], r["k"]), []).append(r)
    out = []
    for (method, strategy, k), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        rounds = sum(r["n_target_forwards"] for r in rs)
        s = {"method": method, "strategy": strategy, "k": k, "n_prompts": len(rs),
             "accepted_per_pass": sum(r["n_accepted"] for r in rs) / max(rounds, 1),
             "tokens_per_pass": sum(r["n_tokens"] for r in rs) / max(rounds, 1),
             "drafted_per_pass": sum(r["n_drafted"] for r in rs) / max(rounds, 1),
             "predicted_accepted_per_pass": (sum(r["predicted"] for r in rs) / max(sum(r["rounds"] for r in rs), 1)
                                             if method != "ar" else 0.0),
             "tokens_per_s": sum(r["n_tokens"] for r in rs) / max(sum(r["wall_s"] for r in rs), 1e-9),
             "acceptance_rate": sum(r["n_accepted"] for r in rs) / max(sum(r["n_drafted"] for r in rs), 1)}
        if method in rates:
            cond = rates[method]["cond_rates"]
            s["tunstall_bound_generated"] = tunstall_accepted(cond, k, vocab) + 1
            s["predicted_0th_order"] = zeroth_order_accepted(cond, "tree" if strategy.startswith("tree") else strategy,
                                                             k, vocab)
        out.append(s)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| method | strategy | k | accepted / pass (measured) | predicted | Tunstall bound (accepted) | "
             "tokens / pass | tok/s | n prompts |", "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        if s["method"] == "ar":
            lines.append(f"| ar | - | 0 | 0 | - | - | 1.00 | {s['tokens_per_s']:.2f} | {s['n_prompts']} |")
            continue
        bound = s.get("tunstall_bound_generated", float("nan")) - 1
        lines.append(f"| {s['method']} | {s['strategy']} | {s['k']} | {s['accepted_per_pass']:.3f} | "
                     f"{s['predicted_accepted_per_pass']:.3f} | {bound:.3f} | {s['tokens_per_pass']:.3f} | "
                     f"{s['tokens_per_s']:.2f} | {s['n_prompts']} |")
    return "\n".join(lines)


def plot(summary: list[dict], methods, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(methods), figsize=(6.2 * len(methods), 4.6), squeeze=False)
    for ax, method in zip(axes[0], methods):
        rows = [s for s in summary if s["method"] == method]
        for strategy in STRATEGIES:
            rs = sorted((s for s in rows if s["strategy"] == strategy), key=lambda s: s["k"])
            if not rs:
                continue
            color, marker = STYLE[strategy]
            ks = [s["k"] for s in rs]
            ax.plot(ks, [s["accepted_per_pass"] for s in rs], color=color, marker=marker, label=f"{strategy} (measured)")
            ax.plot(ks, [s["predicted_accepted_per_pass"] for s in rs], color=color, ls="--", alpha=0.7,
                    label=f"{strategy} (predicted)")
        bound = sorted({(s["k"], s["tunstall_bound_generated"] - 1) for s in rows if "tunstall_bound_generated" in s})
        if bound:
            ax.plot([b[0] for b in bound], [b[1] for b in bound], color="k", ls=":", label="Tunstall upper bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("drafted tokens per target pass (k)")
        ax.set_ylabel("accepted tokens per target pass")
        ax.set_title(f"{method.upper()}: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--target", default="default")
    ap.add_argument("--tiny", action="store_true", help="use tiny random models (smoke test); overrides --draft/--target")
    ap.add_argument("--dataset", default="alpaca", help="alpaca | gsm8k | humaneval | path.jsonl")
    ap.add_argument("--field", default=None)
    ap.add_argument("--prompts", type=int, default=4, help="evaluation prompts")
    ap.add_argument("--calib-prompts", type=int, default=2, help="calibration prompts (disjoint from the others)")
    ap.add_argument("--calib-width", type=int, default=8, help="batch width of the calibration run")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="1,2,4,8,16,32")
    ap.add_argument("--methods", default="gsd,ersd")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--head", default=None, help="acceptance head folder for the tree-head strategy")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-chat", dest="chat", action="store_false", help="feed prompts raw (no chat template)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/bench_trees")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing, load no model: <out>/table.md again from its results.jsonl, calibration.json "
                         "and run.json")
    return ap.parse_args(argv)


def check_choices(args) -> tuple[list[int], list[str], list[str]]:
    """Budgets, methods and strategies from their comma lists; tree-head is dropped without --head."""
    budgets = [int(k) for k in args.budgets.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s]
    for m in methods:
        if m not in ("gsd", "ersd"):
            raise UserError(f"unknown method {m!r}; use gsd and/or ersd")
    for s in strategies:
        if s not in STRATEGIES:
            raise UserError(f"unknown strategy {s!r}; use some of {', '.join(STRATEGIES)}")
    if "tree-head" in strategies and not args.head:
        print("note: no --head given, skipping the tree-head strategy", file=sys.stderr)
        strategies.remove("tree-head")
    return budgets, methods, strategies


def run_pending(pair, eval_prompts, configs, args, sampling, rates: dict, head, settings: dict,
                res_path: Path) -> list[dict]:
    """Runs every (prompt, config) that results.jsonl lacks for these settings, appending each
    row as it finishes (a rerun skips what is done); returns all rows of these settings."""
    from tqdm import tqdm

    rows = [r for r in read_jsonl(res_path) if r.get("settings") == settings]
    done = {(r["prompt_idx"], r["method"], r["strategy"], r["k"]) for r in rows}
    todo = [(i, k, m, s) for i in range(len(eval_prompts)) for k, m, s in configs if (i, m, s, k) not in done]
    bar = tqdm(todo, desc="bench", unit="run", dynamic_ncols=True)
    for i, k, method, strategy in bar:
        ids = pair.encode(eval_prompts[i], chat=args.chat)
        pol = None if method == "ar" else make_policy(method, strategy, k, rates[method]["cond_rates"], head)
        g = pair.decoder.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, policy=pol, seed=i)
        m = g.metrics
        row = {"settings": settings, "prompt_idx": i, "method": method, "strategy": strategy, "k": k,
               "rounds": pol.rounds if pol else m.n_target_forwards, "predicted": pol.predicted if pol else 0.0,
               **m.to_dict()}
        append_jsonl(res_path, row)
        rows.append(row)
        bar.set_postfix_str(f"{method} {strategy} k={k}: {m.n_accepted / max(m.n_target_forwards, 1):.2f} acc/pass "
                            f"{m.tokens_per_s:.1f} tok/s")
    return rows


def table_header(run: dict) -> str:
    """table.md's title and text, from what run.json says of the run (paired.run_header)."""
    return (f"# Tree drafting benchmark\n\n{run['target']} (target) / {run['draft']} (draft), {run['dtype']}, device "
            f"{run['device']}, {run['threads']} threads, {run['n_prompts']} prompts from {run['dataset']}, "
            f"{run['max_new_tokens']} new tokens, temperature {run['temperature']:g}. 'predicted' = sum of R over the "
            f"drafted nodes (0-th order rates from {run['calib_prompts']} calibration prompts; the head's R for "
            f"tree-head); Tunstall bound = Lemma 4.2 bound on generated tokens per pass, minus 1. Written "
            f"{run['written']}.\n\n")


def report(summary: list[dict], run: dict) -> str:
    """table.md: the summary of the run's rows (summarize) with what run.json says of the run."""
    return table_header(run) + table(summary) + "\n"


def report_only(out: Path) -> int:
    """table.md again from the folder alone: the rows of run.json's settings, the calibration they ran
    with (calibration.json) and the vocabulary size run.json keeps."""
    run = run_header(out, report_only=True)
    cal = read_json(out / "calibration.json", hint="--report-only needs the run's calibration")
    if cal.get("settings") != run["settings"]:
        raise UserError(f"{out / 'calibration.json'} is another run's calibration (its settings differ from run.json's)")
    rows = [r for r in read_jsonl(out / "results.jsonl") if r.get("settings") == run["settings"]]
    summary = summarize(rows, {m: cal[m] for m in run["methods"]}, run["vocab_size"])
    (out / "table.md").write_text(report(summary, run))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        return report_only(out)
    from adaptive_spec import SpecPair
    from adaptive_spec.prompts import load_prompts

    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.draft, args.target, tiny_head = make_tiny_pair(out / "tiny_pair")
        args.head = args.head or tiny_head
        args.chat = False
    budgets, methods, strategies = check_choices(args)

    pair = SpecPair.load(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
                         threads=args.threads)
    head = T.load_tree_head(args.head, pair) if "tree-head" in strategies else None
    # evaluation prompts from the front of the (fixed) shuffle, calibration prompts from its end:
    # both stay the same when --prompts changes, so results and calibration can be reused
    prompts = load_prompts(args.dataset, field=args.field)
    if len(prompts) < args.prompts + args.calib_prompts:
        raise UserError(f"{args.dataset} has only {len(prompts)} prompts; lower --prompts / --calib-prompts")
    eval_prompts, calib_prompts = prompts[:args.prompts], prompts[len(prompts) - args.calib_prompts:]
    settings = {k: getattr(args, k) for k in ("draft", "target", "dataset", "max_new_tokens", "temperature", "top_k",
                                             "top_p", "chat", "dtype", "calib_prompts", "calib_width")}
    settings["head"] = args.head
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)

    # warm-up: the first forwards pay for allocation and kernel selection
    ids0 = pair.encode(eval_prompts[0], chat=args.chat)
    pair.decoder.generate(ids0, max_new_tokens=4, sampling=sampling, policy=T.TreePolicy("gsd", "tree", 4))
    cal = calibrate(pair, calib_prompts, methods, args, out / "calibration.json", settings)
    rates = {m: cal[m] for m in methods}
    for m in methods:
        print(f"{m}: conditional acceptance rates c_i = {[round(c, 3) for c in rates[m]['cond_rates'][:8]]} "
              f"(trials {[int(t) for t in rates[m]['trials'][:8]]})", file=sys.stderr)

    configs = [(0, "ar", "-")] + [(k, m, s) for m in methods for s in strategies for k in budgets]
    rows = run_pending(pair, eval_prompts, configs, args, sampling, rates, head, settings, out / "results.jsonl")

    summary = summarize(rows, rates, pair.target.vocab_size)
    title = (f"{Path(str(args.target)).name} / {Path(str(args.draft)).name}, T={args.temperature:g}, "
             f"{len(eval_prompts)} prompts x {args.max_new_tokens} tokens")
    plot(summary, methods, out / "accepted_vs_drafted.png", title)
    (out / "summary.json").write_text(json.dumps({"settings": settings, "rates": rates, "summary": summary}, indent=1))
    run = run_header(out, report_only=False, measure=lambda: {
        "script": "eval/bench_trees.py", "report": "table.md", "target": args.target, "draft": args.draft,
        "dtype": args.dtype, "device": str(pair.target.device), "threads": torch.get_num_threads(),
        "n_prompts": len(eval_prompts), "dataset": args.dataset, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "calib_prompts": len(calib_prompts), "methods": methods,
        "vocab_size": pair.target.vocab_size, "settings": settings})
    md = report(summary, run)
    (out / "table.md").write_text(md)
    print(md, end="")
    print(f"\nplot: {out / 'accepted_vs_drafted.png'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
