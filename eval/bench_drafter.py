"""Tokens per target pass (tau) of the feature drafter beside the 0.5B draft model, greedy, fixed K, chains,
on the torch engine: what drafting from the target's own states buys in acceptance, before any timing.

Rows, per prompt (the first --prompts of HumanEval, GSM8K and AlpacaEval, chat-encoded as the other
benchmarks encode them): the target alone (ar), then fixed K for each K of --ks with the feature drafter
(`--draft feature:PATH`) and with the draft model (`--draft default`), all sharing one loaded target. tau is
new tokens over the target's passes as the decoder counts them (Metrics.n_target_forwards: the target alone
scores 1.00), pooled over a set's prompts. Greedy speculative output must equal the target alone's token for
token: exactly in fp32; in bf16 a K + 1-row pass and a 1-row step may round a near-tie apart, after which the
outputs differ. The report counts the rows that differ and where. Without --timed nothing is timed: the
counts do not depend on the cores' load, so this runs beside other work. --timed also times every row and adds
the target alone on llama.cpp (its GGUF as it is: the CPU user's fastest plain decode) to each prompt, so the
speeds are ratios measured side by side, prompt by prompt, in one run; a timed run shares the cores with nothing.

    python eval/bench_drafter.py --out eval/results/drafter_tau_<cpu>    # ADAPTIVE_SPEC_DATA or --data for
                                                                         # GSM8K and AlpacaEval
    python eval/bench_drafter.py --timed --ks 3 --out eval/results/drafter_speed_<cpu>  # tokens/s beside
                                                                         # torch and llama.cpp alone
    python eval/bench_drafter.py --tiny --prompts 2 --max-new-tokens 16 --out /tmp/t   # smoke test

Resumable: each row goes to <out>/results.jsonl as it finishes (paired.record); a rerun skips the rows it has,
so a larger --prompts extends a run.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from adaptive_spec.errors import UserError, run_main
from adaptive_spec.evaluation.paired import pooled_tok_s, record, run_header, start
from adaptive_spec.runs import read_jsonl
from adaptive_spec.tables import md_table

DRAFTER = "checkpoints/drafter-qwen-coder-1.5b-cpu"
SETS = "humaneval,gsm8k,alpaca"
NAMES = {"humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "AlpacaEval"}
AR = {"policy": "ar"}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10, help="per set")
    ap.add_argument("--sets", default=SETS, help="prompt sets (prompts.py names)")
    ap.add_argument("--ks", default="2,3,4,6", help="fixed K values")
    ap.add_argument("--confidence", default="", help="also the training-free confidence stop (drafting stops after "
                    "a token with q < tau, at most --k-max) for each tau of this comma-separated list")
    ap.add_argument("--k-max", type=int, default=8, help="the confidence and SpecDec++ stops' longest draft")
    ap.add_argument("--thresholds", default="", help="also SpecDec++ (the learned stop: drafting stops when "
                    "1 - prod p_hat > h) for each h of this comma-separated list, with --head for the drafter's "
                    "rows and --draft-head for the draft model's")
    ap.add_argument("--head", default=None, help="acceptance head on the drafter's states (adaptive-spec "
                    "datagen-drafter, then train.py)")
    ap.add_argument("--draft-head", default=None, help="acceptance head on the draft model's states")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (and the equality check); 1: the "
                    "sampled setting the heads are trained for (seed 0 per row; tau is then a sample)")
    ap.add_argument("--top-k", type=int, default=0, help="top-k with --temperature > 0 (0: none)")
    ap.add_argument("--drafter", default=DRAFTER, help="the feature drafter's folder or hub id")
    ap.add_argument("--draft", default="default", help="the draft model it is compared with")
    ap.add_argument("--drafts", default="feature,draft", help="which rows to run beside ar: feature (the drafter), "
                    "draft (the draft model); the draft model's rows need no drafter, so they can run first")
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft-vocab", default=None, help="the drafter's output vocabulary: N | FILE | FILE:N | full "
                    "as generate's --draft-vocab (default: the one its cross-entropy was trained on)")
    ap.add_argument("--dtype", default="fp32", help="fp32: greedy equality holds exactly; bf16: up to near-ties")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=None, help="folder of the offline prompt sets (sets ADAPTIVE_SPEC_DATA)")
    ap.add_argument("--timed", action="store_true", help="time every row and add the target alone on llama.cpp "
                    "(needs llama-cpp-python; run alone on the cores)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models and a random drafter (smoke test)")
    ap.add_argument("--out", default="eval/results/drafter_tau")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of the rows <out> holds")
    return ap.parse_args(argv)


def make_tiny(folder: Path) -> tuple[str, str, str]:
    """(target, draft, drafter) folders: tiny random Qwen2 models sharing a 32-token tokenizer and a random
    feature drafter over the target."""
    from transformers import AutoModelForCausalLM

    from adaptive_spec.backends.toy import save_model
    from adaptive_spec.drafter.model import FeatureDrafter

    t, d, f = folder / "target", folder / "draft", folder / "drafter"
    if not (t / "config.json").is_file():
        save_model(t, vocab_size=32, hidden_size=24, seed=2, logit_scale=4.0, max_positions=512)
    if not (d / "config.json").is_file():
        save_model(d, vocab_size=32, hidden_size=16, seed=1, logit_scale=4.0, max_positions=512)
    if not (f / "config.json").is_file():
        torch.manual_seed(0)
        FeatureDrafter.for_target(AutoModelForCausalLM.from_pretrained(t), name="tiny").save_pretrained(f)
    return str(t), str(d), str(f)


def load_pairs(args, feature: bool) -> dict:
    """{"draft model": the target with the draft model, "feature drafter" (when `feature`): the same target
    runner behind a HiddenTap with the drafter}: one target in memory, each generation resets the caches it
    uses."""
    from adaptive_spec.decoding.pipeline import SpecPair
    from adaptive_spec.drafter.source import drafter_over, load_drafter

    pair = SpecPair.load(target=args.target, draft=args.draft, dtype=args.dtype, threads=args.threads,
                         backend="torch", device="cpu")
    pairs = {"draft model": pair}
    if args.timed and not args.tiny:  # the tiny models have no GGUF files
        pairs["llama.cpp"] = SpecPair.load(target=args.target, draft=None, threads=args.threads, backend="llama.cpp")
    if not feature:
        return pairs
    model = getattr(pair.target, "model", None)
    if model is None:
        raise UserError(f"the target's runner ({type(pair.target).__name__}) holds no Hugging Face model for the "
                        "drafter to read through; run on a CPU (the eager torch runner)")
    drafter = load_drafter(args.drafter, hidden_size=model.config.hidden_size)
    tap, runner, vocab = drafter_over(pair.target, model, pair.tokenizer, drafter, args.draft_vocab)
    feature = SpecPair(tap, runner, pair.tokenizer, pair.eos_token_ids, pair.engine, pair.params,
                       {"drafter": "feature", "draft_vocab": vocab})
    return {**pairs, "feature drafter": feature}


def prompt_ids(pair, args) -> dict:
    """{set: [ids]}: the first --prompts of each set, chat-encoded (tiny: raw, the last 32 tokens)."""
    from adaptive_spec.prompts import load_prompts

    out = {}
    for name in args.sets.split(","):
        texts = load_prompts(name, n=args.prompts)
        out[name] = [pair.encode(t, chat=False)[-32:] if args.tiny else pair.encode(t, chat=True) for t in texts]
    return out


def measure(pair, ids, policy: dict, n: int, timed: bool = False, temperature: float = 0.0, top_k: int = 0) -> dict:
    g = pair.generate(ids, temperature=temperature, top_k=top_k, seed=0, max_new_tokens=n, **policy)
    m = g.metrics
    row = {"n_tokens": m.n_tokens, "n_target_forwards": m.n_target_forwards, "n_drafted": m.n_drafted,
           "n_accepted": m.n_accepted, "accepted_hist": {str(a): c for a, c in m.accepted_hist.items()},
           "threads": torch.get_num_threads(), "token_ids": list(g.token_ids)}
    if timed:  # decode_s leaves the prompt's prefill out, as the engine benchmarks do
        row.update(wall_s=m.wall_s, prefill_s=m.prefill_s, decode_s=m.wall_s - m.prefill_s, draft_s=m.draft_s,
                   target_s=m.target_s, draft_prefill_s=m.draft_prefill_s, target_prefill_s=m.target_prefill_s,
                   n_draft_forwards=m.n_draft_forwards)
    return row


def run(args, out: Path, results: Path, done: set) -> dict:
    """Every missing row; returns what run.json records of the run."""
    from adaptive_spec.backends.cpu.machine import flags_line
    from adaptive_spec.drafter.source import load_drafter
    from adaptive_spec.heads.head import INPUTS, load_head

    drafts = {"feature": "feature drafter", "draft": "draft model"}
    wanted = [drafts[d] for d in args.drafts.split(",") if d in drafts]
    if not wanted or len(wanted) != len(args.drafts.split(",")):
        raise UserError(f"--drafts {args.drafts}: name feature, draft or both (comma-separated)")
    pairs = load_pairs(args, "feature drafter" in wanted)
    ks = [int(k) for k in args.ks.split(",") if k]
    sets = prompt_ids(pairs["draft model"], args)
    # prompt i of every set before prompt i + 1 of any: a run cut short still covers every set
    order = sorted(((i, name, ids) for name, prompts in sets.items() for i, ids in enumerate(prompts)),
                   key=lambda t: t[0])
    if args.timed:  # one short generation per configuration first: first calls pay one-time set-up
        for label in [x for x in pairs if x not in wanted] + wanted:
            pairs[label].generate(order[0][2], temperature=0, max_new_tokens=8,
                                  **(AR if label == "llama.cpp" else {"policy": "fixed", "k": ks[0]}))
    taus = [float(t) for t in args.confidence.split(",") if t]
    hs = [float(h) for h in args.thresholds.split(",") if h]
    heads = {label: load_head(path, hidden_size=pairs[label].draft.hidden_size, inputs=INPUTS)  # once, not per row
             for label, path in (("feature drafter", args.head), ("draft model", args.draft_head))
             if path and label in wanted and hs}
    if hs and not heads:
        raise UserError("--thresholds runs SpecDec++, which needs a head: pass --head (the drafter's) or "
                        "--draft-head (the draft model's)")
    for i, name, ids in order:
        configs = [("ar", pairs["draft model"], AR)] + [
            (f"{label} K={k}", pairs[label], {"policy": "fixed", "k": k}) for label in wanted for k in ks] + [
            (f"{label} conf={t:g}", pairs[label], {"policy": "confidence", "threshold": t, "k_max": args.k_max})
            for label in wanted for t in taus] + [
            (f"{label} h={h:g}", pairs[label], {"policy": "learned", "head": heads[label], "threshold": h,
                                                "k_max": args.k_max})
            for label in wanted if heads.get(label) for h in hs]
        configs += [("llama.cpp ar", pairs["llama.cpp"], AR)] if "llama.cpp" in pairs else []
        for config, pair, policy in configs:
            record(results, done, {"dataset": name, "prompt_idx": i, "temperature": args.temperature,
                                   "top_k": args.top_k,
                                   "engine": "llama.cpp" if config == "llama.cpp ar" else "torch",
                                   "config": config, "prompt_tokens": len(ids)},
                   lambda pair=pair, ids=ids, policy=policy: measure(pair, ids, policy, args.max_new_tokens, args.timed,
                                                                     args.temperature, args.top_k))
    extra = load_drafter(args.drafter).extra  # its training metadata, for the report, whichever rows ran
    return {"script": f"eval/{Path(__file__).name}", "cpu": flags_line(), "threads": torch.get_num_threads(),
            "dtype": args.dtype, "target": args.target, "draft": args.draft, "drafter": args.drafter,
            "draft_vocab": pairs["feature drafter"].draft_config["draft_vocab"] if "feature drafter" in pairs
            else "full", "drafter_metrics": extra.get("metrics", {}),
            "max_new_tokens": args.max_new_tokens, "ks": ks,
            "sets": list(sets), "prompts": args.prompts, "drafts": wanted, "tiny": args.tiny, "timed": args.timed,
            "confidence": taus, "k_max": args.k_max, "thresholds": hs, "temperature": args.temperature,
            "top_k": args.top_k, "head": args.head,
            "draft_head": args.draft_head}


def _main(argv) -> int:
    args = parse_args(argv)
    if args.data:
        os.environ["ADAPTIVE_SPEC_DATA"] = str(Path(args.data).resolve())
    out, results, done = start(args.out, args.threads)
    if args.report_only:  # from the folder alone: its rows and run.json
        (out / "report.md").write_text(report(list(read_jsonl(results)), run_header(out, report_only=True)))
        return 0
    if args.tiny:  # a --draft given is kept (a test drafts with the tiny target itself)
        target, draft, args.drafter = make_tiny(out / "tiny_models")
        args.target, args.draft = target, draft if args.draft == "default" else args.draft
        args.sets = "humaneval"
    held = {(r["temperature"], r.get("top_k", 0)) for r in read_jsonl(results)} if results.is_file() else set()
    if held - {(args.temperature, args.top_k)}:  # the report pools a configuration's rows whatever their sampling
        t, k = sorted(held)[0]
        raise UserError(f"{out} holds rows sampled at temperature {t:g}, top-k {k}; rerun with those, or give this "
                        "sampling its own --out")
    settings = run(args, out, results, done)
    md = report(list(read_jsonl(results)), run_header(out, report_only=False, measure=lambda: settings))
    (out / "report.md").write_text(md)
    print(md)
    return 0


def _pooled(rows: list[dict]) -> tuple[str, str]:
    """(tau, acceptance) pooled over rows."""
    passes, drafted = sum(r["n_target_forwards"] for r in rows), sum(r["n_drafted"] for r in rows)
    tau = f"{sum(r['n_tokens'] for r in rows) / passes:.2f}" if passes else "—"
    return tau, (f"{sum(r['n_accepted'] for r in rows) / drafted:.3f}" if drafted else "—")


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(rows: list[dict], run: dict) -> str:
    """The report of the rows, with what run.json says of the run (paired.run_header). Each (set, K) is pooled
    over the prompts that have both drafts' rows at that K, so the drafts are compared on the same prompts
    (the K values are the rows': runs of some K each make one report)."""
    ks = sorted({int(r["config"].rsplit("=", 1)[1]) for r in rows if "K=" in r["config"]})
    by = {(r["dataset"], r["prompt_idx"], r["config"]): r for r in rows}
    prompts = defaultdict(list)
    for ds, i in dict.fromkeys((r["dataset"], r["prompt_idx"]) for r in rows):
        prompts[ds].append(i)
    m = run.get("drafter_metrics", {})
    dev = (f" (dev: top-1 {m['dev_top1']:.3f}, expected acceptance at T = 1 {m['dev_accept']:.3f}, at step "
           f"{m['step']})" if "dev_top1" in m else "")
    t = run.get("temperature", 0.0)
    mode = "greedy" if not t else f"T = {t:g}" + (f", top-k {run['top_k']}" if run.get("top_k") else "")
    lines = [f"# Tokens per target pass: the feature drafter beside the draft model, {mode}, torch {run['dtype']}, "
             f"{run['max_new_tokens']} tokens", "", run["cpu"], "",
             f"Feature drafter: `{run['drafter']}`{dev}, read out over {run.get('draft_vocab', 'full')} tokens. "
             f"Draft model: `{run['draft']}`. Target: `{run['target']}`. "
             "tau: new tokens over the target's passes (the decoder's count: the target alone scores 1.00), "
             "pooled over a set's prompts; acceptance: accepted over drafted tokens. Fixed K, chains, "
             f"{run['threads']} threads; " + ("timed, alone on the cores." if run.get("timed") else "nothing timed."), ""]
    head = ["set", "prompts", "K", "feature drafter tau", "acceptance", "draft model tau", "acceptance"]
    table, every = [], defaultdict(list)
    for ds, idx in prompts.items():
        for k in ks:
            both = [i for i in idx if all((ds, i, f"{d} K={k}") in by for d in ("feature drafter", "draft model"))]
            if both:
                feat, draft = ([by[(ds, i, f"{d} K={k}")] for i in both] for d in ("feature drafter", "draft model"))
                every[k].append((len(both), feat, draft))
                table.append([NAMES.get(ds, ds), str(len(both)), str(k), *_pooled(feat), *_pooled(draft)])
    for k in ks:
        if len(every[k]) > 1:
            feat, draft = ([r for part in every[k] for r in part[j]] for j in (1, 2))
            table.append(["all", str(sum(part[0] for part in every[k])), str(k), *_pooled(feat), *_pooled(draft)])
    lines += [md_table(head, table), ""] if table else ["No prompt has both drafts' rows at some K yet.", ""]
    lines += _every_config(rows, prompts)
    lines += _speed(rows) + (_equality(rows, by) if not t else []) + [f"Written {run['written']} by `python eval/bench_drafter.py`."]
    return "\n".join(lines) + "\n"


def _every_config(rows: list[dict], prompts: dict) -> list[str]:
    """tau and acceptance of every configuration (fixed K, the confidence stop, SpecDec++) per set and pooled,
    over the prompts that ran every configuration."""
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c not in ("ar", "llama.cpp ar")]
    have = defaultdict(set)
    for r in rows:
        have[(r["dataset"], r["prompt_idx"])].add(r["config"])
    full = [key for key, got in have.items() if set(configs) <= got]
    if len(configs) < 2 or not full:
        return []
    sets = [ds for ds in prompts if any(k[0] == ds for k in full)]
    of = lambda c, ds=None: [r for r in rows if r["config"] == c and (r["dataset"], r["prompt_idx"]) in full  # noqa: E731
                             and ds in (None, r["dataset"])]
    table = [[c, *(_pooled(of(c, ds))[0] for ds in sets), *_pooled(of(c))] for c in configs]
    return [f"Every configuration, pooled over the {len(full)} prompts that ran them all:", "",
            md_table(["configuration", *(f"{NAMES.get(ds, ds)} tau" for ds in sets), "all tau", "acceptance"], table),
            ""]


def _speed(rows: list[dict]) -> list[str]:
    """Decode tokens/s per configuration (prefill left out), pooled over the prompts that ran every timed
    configuration, with its ratio to the target alone on torch and on llama.cpp: --timed runs only."""
    timed = [r for r in rows if "decode_s" in r]
    configs = list(dict.fromkeys(r["config"] for r in timed))
    have = defaultdict(set)
    for r in timed:
        have[(r["dataset"], r["prompt_idx"])].add(r["config"])
    full = {key for key, got in have.items() if got == set(configs)}
    if not full or "ar" not in configs:
        return []
    of = {c: [r for r in timed if r["config"] == c and (r["dataset"], r["prompt_idx"]) in full] for c in configs}
    speed = {c: pooled_tok_s(of[c]) for c in configs}
    base = {"torch": speed["ar"], "llama.cpp": speed.get("llama.cpp ar")}
    table = [[c, _pooled(of[c])[0], _cost_ratio(of[c], of["ar"]), f"{speed[c]:.2f}", f"{speed[c] / base['torch']:.2f}",
              f"{speed[c] / base['llama.cpp']:.2f}" if base["llama.cpp"] else "—"] for c in configs]
    return [f"Decode speed (tokens/s without the prompt's prefill), pooled over the {len(full)} prompts that ran "
            "every configuration, back to back per prompt:", "",
            md_table(["configuration", "tau", "c", "tok/s", "vs torch alone", "vs llama.cpp alone"], table),
            "", "c: the draft's time per forward over the target alone's per step, both without the prefill, from "
            "the decoder's own clock (Metrics.draft_s, target_s).", ""]


def _cost_ratio(rows: list[dict], ar: list[dict]) -> str:
    """t_draft / t_target pooled over the rows: a draft forward's mean time over the target alone's step."""
    drafted = sum(r.get("n_draft_forwards", 0) for r in rows)
    steps = sum(r["n_target_forwards"] for r in ar)
    if not drafted or not steps or any("draft_s" not in r for r in rows + ar):
        return "—"
    t_draft = sum(r["draft_s"] - r["draft_prefill_s"] for r in rows) / drafted
    return f"{t_draft / (sum(r['target_s'] - r['target_prefill_s'] for r in ar) / steps):.3f}"


def _equality(rows: list[dict], by: dict) -> list[str]:
    """Greedy equality with the target alone: every speculative row against its prompt's ar row."""
    spec = [r for r in rows if r["config"] not in ("ar", "llama.cpp ar")  # llama.cpp: other numerics
            and (r["dataset"], r["prompt_idx"], "ar") in by]
    bad = [(r, _first_diff(r["token_ids"], by[(r["dataset"], r["prompt_idx"], "ar")]["token_ids"])) for r in spec
           if r["token_ids"] != by[(r["dataset"], r["prompt_idx"], "ar")]["token_ids"]]
    out = [f"Greedy equality: {len(spec) - len(bad)} of {len(spec)} speculative outputs equal the target alone's "
           "token for token.", ""]
    if bad:
        out += [md_table(["set", "prompt", "configuration", "first differing token", "tokens"],
                         [[NAMES.get(r["dataset"], r["dataset"]), str(r["prompt_idx"]), r["config"], str(d),
                           str(r["n_tokens"])] for r, d in bad]), ""]
    return out


def main(argv=None) -> int:
    return run_main(_main, sys.argv[1:] if argv is None else argv,
                    "finished rows are kept in results.jsonl; rerun the same command to resume")


if __name__ == "__main__":
    sys.exit(main())
