"""`adaptive-spec` command line: fetch-models, generate, datagen, sweep, ..."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import UserError


def _add_generate(sub):
    g = sub.add_parser("generate", help="generate text with a draft/target pair",
                       description="Generate from the target, speculatively drafting with the draft model.")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--draft", default="default", help="draft model: hub id, local folder or 'default'")
    g.add_argument("--target", default="default", help="target model: hub id, local folder or 'default'")
    g.add_argument("--policy", default="fixed",
                   help="ar (target only) | fixed | learned | confidence | entropy | heuristic | oracle | "
                        "tree | ersd | spectr | batch-sd")
    g.add_argument("--k", type=int, default=None, help="candidates per round for --policy fixed (default 4)")
    g.add_argument("--threshold", type=float, default=None, help="h (learned) or tau (heuristics)")
    g.add_argument("--head", default=None, help="acceptance head folder for --policy learned")
    g.add_argument("--k-max", type=int, default=None, help="hard cap on candidates per round (learned: 20)")
    g.add_argument("--tree-budget", type=int, default=None, help="drafted tokens per round for tree policies")
    g.add_argument("--tree-estimator", default=None, help="positional | head: acceptance estimates for the tree")
    g.add_argument("--drafting", default=None,
                   help="tree (optimal) | sequence | batch | specinfer: draft shape for --policy tree / ersd")
    g.add_argument("--tree-rates", default=None,
                   help="calibration.json of per-sibling acceptance rates for tree policies (bench_trees writes one)")
    g.add_argument("--num-drafts", type=int, default=None, help="drafts per round for spectr / batch-sd")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--backend", default="dynamic", choices=["dynamic", "static"],
                   help="KV caches: dynamic (grow and crop) or static (preallocated, indexed by position)")
    g.add_argument("--runtime", default="eager", choices=["eager", "cudagraph", "compile"],
                   help="static backend on GPU: capture one CUDA graph per input length (cudagraph/compile)")
    g.add_argument("--max-cache-len", type=int, default=None, help="static backend: preallocated positions")


def _generate(args) -> int:
    from .pipeline import SpecPair

    names = ("k", "threshold", "head", "k_max", "tree_budget", "tree_estimator", "drafting", "num_drafts",
             "tree_rates")
    policy_kwargs = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would drown the streamed text
    if not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    # validate cheap arguments before loading gigabytes of weights
    from .sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.k is not None and args.k < 1:
        raise UserError(f"--k must be >= 1, got {args.k}")
    pair = SpecPair.load(target=args.target, draft=None if args.policy == "ar" else args.draft,
                         dtype=args.dtype, device=args.device, backend=args.backend, runtime=args.runtime,
                         max_cache_len=args.max_cache_len)
    stream = None if args.json else (lambda s: print(s, end="", flush=True))
    g = pair.generate(args.prompt, policy=args.policy, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      chat=args.chat, on_text=stream, **policy_kwargs)
    m = g.metrics
    if args.json:
        metrics = {k: getattr(m, k) for k in ("n_tokens", "n_draft_forwards", "n_target_forwards", "n_discarded",
                                               "discard_rate", "verification_rate", "acceptance_rate", "wall_s")}
        metrics.update({k: v for k, v in m.to_dict().items() if k not in metrics})
        print(json.dumps({"text": g.text, "token_ids": g.token_ids, "metrics": metrics,
                          "policy": args.policy, "stopped_by": g.stopped_by}))
    else:
        print()
        print(f"[{args.policy}] {m.summary()}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="adaptive-spec", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    # subcommands with their own argument parsers: everything after the name is theirs
    delegated = {
        "fetch-models": ("adaptive_spec.fetch", "build the default model pair into the local cache"),
        "datagen": ("adaptive_spec.datagen", "generate token-mixed acceptance data for training heads"),
        "sweep": ("adaptive_spec.sweep", "threshold / K sweeps over prompt sets"),
        "report": ("adaptive_spec.report", "tables and Pareto plots from sweep results"),
    }
    for name, (_, help_) in delegated.items():
        sub.add_parser(name, help=help_, add_help=False)
    if argv and argv[0] in delegated:
        import importlib

        try:
            mod = importlib.import_module(delegated[argv[0]][0])
        except ModuleNotFoundError as e:
            print(f"error: '{argv[0]}' is not available in this version ({e})", file=sys.stderr)
            return 2
        return mod.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            return _generate(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
