"""`adaptive-spec` command line: fetch-models, generate, datagen, datagen-features, train, autotune, sweep, report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import UserError, run_main

DRAFT_QUANTS = ("none", "int8", "int4")  # models.QUANTS, spelled out: --help must not import torch

# used when pipeline.policy_names() cannot be imported (an older pipeline.py)
KNOWN_POLICIES = ("ar", "fixed", "learned", "confidence", "entropy", "heuristic", "oracle", "tree", "ersd", "spectr",
                  "batch-sd")
# subcommands with their own argument parsers: everything after the name is theirs
DELEGATED = {
    "fetch-models": ("adaptive_spec.fetch", "build the default model pair into the local cache"),
    "datagen": ("adaptive_spec.datagen", "generate token-mixed acceptance data for training heads"),
    "train": ("adaptive_spec.training", "train acceptance heads on datagen output (also: train.py)"),
    "sweep": ("adaptive_spec.sweep", "threshold / K sweeps over prompt sets"),
    "report": ("adaptive_spec.report", "tables and Pareto plots from sweep results"),
}


class _Parser(argparse.ArgumentParser):
    """Bad arguments get the one `error: ...` line every other mistake gets, not a usage dump."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("adaptive_spec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def policy_names() -> list[str]:
    """The registered stop policies (imported lazily: pipeline pulls in torch)."""
    try:
        from .pipeline import policy_names as registered
    except ImportError:
        return list(KNOWN_POLICIES)
    return list(registered())


def _policy(names: list[str]):
    def check(name: str) -> str:
        if name not in names:
            raise argparse.ArgumentTypeError(f"unknown policy {name!r}; choose one of {', '.join(names)}")
        return name

    return check


def _add_generate(sub):
    g = sub.add_parser("generate", help="generate text with a draft/target pair",
                       description="Generate from the target, speculatively drafting with the draft model.")
    names = policy_names()
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--policy", default="fixed", type=_policy(names), choices=names, metavar="POLICY",
                   help=f"stop policy: {', '.join(names)} (ar = target only; default fixed)")
    _add_policy_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def _add_model_args(g):
    g.add_argument("--draft", default="default", help="draft model: hub id, local folder or 'default'")
    g.add_argument("--target", default="default", help="target model: hub id, local folder or 'default'")
    g.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                   help="weights' dtype (default auto: bf16 on GPUs and on CPUs with bf16 kernels, fp32 on "
                        "AVX2-only CPUs, where bf16 matrix products are several times slower)")
    g.add_argument("--draft-quant", default="none", choices=DRAFT_QUANTS,
                   help="draft weights: none, int8 (weight-only, per-channel) or int4 (weight-only, groups of 64; "
                        "CPU); exactness unchanged")
    g.add_argument("--draft-vocab", default=None, metavar="N|FILE|FILE:N",
                   help="draft output layer keeps the N most frequent tokens (shipped list for the default "
                        "tokenizer) or those of a list from `adaptive-spec draft-vocab`; default: all")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--backend", default="torch", choices=["torch", "llama.cpp"],
                   help="engine: torch (Hugging Face weights; the default pair dequantized to bf16) or llama.cpp "
                        "(the GGUF files as they are, through llama-cpp-python; CPU)")
    g.add_argument("--n-ctx", type=int, default=None, help="llama.cpp: context positions (default 4096)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's count)")
    g.add_argument("--kv-cache", default="dynamic", choices=["dynamic", "static"],
                   help="torch: KV caches dynamic (grow and crop) or static (preallocated, indexed by position)")
    g.add_argument("--runtime", default="eager", choices=["eager", "cudagraph", "compile"],
                   help="static KV cache on GPU: capture one CUDA graph per input length (cudagraph/compile)")
    g.add_argument("--max-cache-len", type=int, default=None, help="static KV cache: preallocated positions")


def _number_or_auto(kind):
    def parse(s: str):
        if s == "auto":
            return s
        try:
            return kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} or auto, "
                                             f"got {s!r}") from None

    return parse


def _add_policy_args(g):
    g.add_argument("--k", type=_number_or_auto(int), default=None,
                   help="candidates per round for --policy fixed (default 4; auto: the K of best predicted "
                        "throughput on this machine, from a curve), tokens per draft for spectr / batch-sd")
    g.add_argument("--threshold", type=_number_or_auto(float), default=None,
                   help="h in (0, 1) for learned (auto: the h of best predicted throughput on this machine, from "
                        "the head's threshold_curve.json), tau in (0, 1) for confidence, tau > 0 nats for entropy")
    g.add_argument("--curve", default=None,
                   help="threshold_curve.json (or its folder) for --threshold auto / --k auto; default: the one "
                        "beside --head (made by `adaptive-spec autotune`)")
    g.add_argument("--head", default=None, help="acceptance head folder (or hub id) for --policy learned")
    g.add_argument("--k-max", type=int, default=None, help="hard cap on candidates per round (learned: 20)")
    g.add_argument("--tree-budget", type=int, default=None, help="drafted tokens per round for tree policies")
    g.add_argument("--tree-estimator", default=None, choices=("positional", "head"),
                   help="acceptance estimates for the tree: positional rates or a trained head (--head)")
    g.add_argument("--drafting", default=None, choices=("tree", "sequence", "batch", "specinfer"),
                   help="draft shape for --policy tree / ersd (tree = the optimal one)")
    g.add_argument("--tree-rates", default=None,
                   help="calibration.json of per-sibling acceptance rates for tree policies (bench_trees writes one)")
    g.add_argument("--num-drafts", type=int, default=None, help="drafts per round for spectr / batch-sd")
    g.add_argument("--tree-learned", action="store_true", default=None,
                   help="tree / ersd: draft as many tokens per round as are worth their cost (at most --tree-budget)")
    g.add_argument("--tree-node-cost", type=float, default=None,
                   help="with --tree-learned: the cost of one drafted token in target steps (default: measured)")


def _add_sampling_args(g):
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, >= 0 (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, >= 0 (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate, >= 1")
    g.add_argument("--seed", type=int, default=0, help="random seed of the sampling")


POSITIVE = ("k", "k_max", "max_new_tokens", "tree_budget", "num_drafts", "max_cache_len", "n_ctx", "threads")


def validate(args):
    """Every check that needs no model, before gigabytes of weights load."""
    from .sampling import SamplingParams

    if not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    SamplingParams(args.temperature, args.top_k, args.top_p)
    for name in POSITIVE:
        v = getattr(args, name)
        if v is not None and v != "auto" and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.tree_node_cost is not None and not args.tree_node_cost > 0:
        raise UserError(f"--tree-node-cost must be > 0 (target steps per drafted token), got {args.tree_node_cost}")
    _validate_threshold(args.policy, args.threshold)
    if args.policy == "learned" or args.tree_estimator == "head":
        _validate_head(args.head, args.policy if args.policy == "learned" else "--tree-estimator head")
    _validate_auto(args)
    if args.policy == "oracle" and args.temperature > 0:
        raise UserError("the hindsight oracle is defined for greedy decoding; use --temperature 0")
    _validate_draft_vocab(args.draft_vocab)
    if args.backend == "llama.cpp":
        _validate_llama_cpp(args)
    elif args.n_ctx is not None:
        raise UserError("--n-ctx sets the llama.cpp context; the torch backend sizes its caches itself")


def _validate_llama_cpp(args):
    """The llama.cpp backend's refusals, before any weights load: the binding, the policy, a head that
    reads hidden states, and the torch-only settings."""
    from .llamacpp import check_policy, import_llama_cpp

    torch_only = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, default in
                  (("dtype", "auto"), ("draft_quant", "none"), ("draft_vocab", None), ("kv_cache", "dynamic"),
                   ("runtime", "eager"), ("max_cache_len", None)) if getattr(args, k) != default]
    if args.device not in (None, "cpu"):
        torch_only.append(f"--device {args.device}")
    if torch_only:
        raise UserError(f"{', '.join(torch_only)}: the llama.cpp backend runs the GGUF files as they are, on the CPU; "
                        "drop these flags or use --backend torch")
    check_policy(args.policy)
    if args.policy == "learned" and args.head and (Path(args.head).expanduser() / "config.json").is_file():
        inputs = json.loads((Path(args.head).expanduser() / "config.json").read_text()).get("inputs", "hidden")
        if inputs != "stats":
            raise UserError(f"the head at {args.head} reads the draft's hidden states (inputs={inputs}), which llama.cpp "
                            "does not give; use a statistics head (inputs=stats, e.g. "
                            "checkpoints/qwen-coder-0.5b-int8-stats-d3) or --backend torch")
    import_llama_cpp()


def _validate_draft_vocab(spec: str | None):
    """N must be a positive count (its upper bound, the vocabulary, is checked at load); a FILE must exist."""
    from .vocab import parse_draft_vocab

    parsed = parse_draft_vocab(spec)
    if parsed is None:
        return
    path, n = parsed
    if n is not None and n < 1:
        raise UserError(f"--draft-vocab must be a token count >= 1 or a token-list file, got {spec}")
    if path and not Path(path).is_file():
        raise UserError(f"--draft-vocab file {path} does not exist; build one with `adaptive-spec draft-vocab`")


def _validate_auto(args):
    """auto belongs to one policy each, and its curve must exist before any model loads."""
    from .autotune import load_curve

    for flag, value, policy, need in (("--threshold", args.threshold, "learned", "h"), ("--k", args.k, "fixed", "k")):
        if value != "auto":
            continue
        if args.policy != policy:
            raise UserError(f"{flag} auto is for --policy {policy} (got {args.policy}); pass a number instead")
        load_curve(args.curve or args.head, need, args.head)


def _validate_threshold(policy: str, h: float | str | None):
    if policy == "learned" and h is None:
        raise UserError("the learned policy needs --threshold h in (0, 1) (the paper's best is about 0.7), or "
                        "--threshold auto")
    if h is None or h == "auto":
        return
    if policy in ("learned", "confidence") and not 0.0 < h < 1.0:
        raise UserError(f"--threshold for {policy} must be in (0, 1), got {h}")
    if policy == "entropy" and not h > 0.0:
        raise UserError(f"--threshold for entropy must be > 0 nats, got {h}")


def _validate_head(head: str | None, who: str):
    if not head:
        raise UserError(f"{who} needs a trained acceptance head: pass --head PATH (e.g. "
                        "checkpoints/qwen-coder-0.5b-d3-wrej6)")
    p = Path(head).expanduser()
    # owner/name could be a hub repo id; anything else that is not a folder is a typo
    looks_like_repo = head.count("/") == 1 and not head.startswith((".", "/", "~"))
    if not p.is_dir() and not looks_like_repo:
        raise UserError(f"acceptance head folder {head} does not exist; pass a folder written by train.py")


def _generate(args) -> int:
    validate(args)
    from transformers.utils import logging as hf_logging

    from .pipeline import SpecPair

    hf_logging.disable_progress_bar()  # weight-loading bars would drown the streamed text
    names = ("k", "threshold", "head", "k_max", "tree_budget", "tree_estimator", "drafting", "num_drafts",
             "tree_rates", "curve", "tree_learned", "tree_node_cost")
    policy_kwargs = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.backend == "llama.cpp":
        pair = SpecPair.load(target=args.target, draft=None if args.policy == "ar" else args.draft,
                             backend="llama.cpp", n_ctx=args.n_ctx, num_threads=args.threads)
    else:
        pair = SpecPair.load(target=args.target, draft=None if args.policy == "ar" else args.draft,
                             dtype=args.dtype, device=args.device, kv_cache=args.kv_cache, runtime=args.runtime,
                             max_cache_len=args.max_cache_len, draft_quant=args.draft_quant,
                             draft_vocab=args.draft_vocab, num_threads=args.threads)
    stream = None if args.json else (lambda s: print(s, end="", flush=True))
    g = pair.generate(args.prompt, policy=args.policy, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      chat=args.chat, on_text=stream, **policy_kwargs)
    _print_result(g, args, pair.runtime_info())
    return 0


def _print_result(g, args, runtime: dict):
    m = g.metrics
    if not args.json:
        print()
        print(f"[{args.policy}] {m.summary()}", file=sys.stderr)
        return
    metrics = {k: getattr(m, k) for k in ("n_tokens", "n_draft_forwards", "n_target_forwards", "n_discarded",
                                           "discard_rate", "verification_rate", "acceptance_rate", "wall_s")}
    metrics.update({k: v for k, v in m.to_dict().items() if k not in metrics})
    print(json.dumps({"text": g.text, "token_ids": g.token_ids, "metrics": metrics, "policy": args.policy,
                      "stopped_by": g.stopped_by, "auto": getattr(g, "auto", None), "runtime": runtime}, default=str))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="adaptive-spec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="what to run")
    _add_generate(sub)
    for name, (_, help_) in DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    sub.add_parser("datagen-features", help="derive the draft's hidden states for a datagen run stored without them",
                   add_help=False)
    sub.add_parser("draft-vocab", help="count token frequencies for a reduced draft vocabulary (--draft-vocab)",
                   add_help=False)
    sub.add_parser("autotune", help="predict throughput per threshold h and per K from a head and dev data "
                   "(for --threshold auto / --k auto)", add_help=False)
    return parser


def _delegate(name: str, argv: list[str]) -> int:
    import importlib

    try:
        mod = importlib.import_module(DELEGATED[name][0])
    except ModuleNotFoundError as e:
        print(f"error: '{name}' is not available in this version ({e})", file=sys.stderr)
        return 2
    # the modules handle their own errors; this catches a Ctrl-C during their imports or set-up
    interrupted = getattr(mod, "INTERRUPTED", "nothing was changed; run the same command again")
    return run_main(mod.main, argv, interrupted)


def _draft_vocab(argv: list[str]) -> int:
    """adaptive-spec draft-vocab: count token frequencies over texts and write a token list for
    --draft-vocab (vocab.py)."""
    from transformers import AutoTokenizer

    from .models import resolve_model_path
    from .vocab import build_token_list

    ap = _Parser(prog="adaptive-spec draft-vocab", description=_draft_vocab.__doc__)
    ap.add_argument("--tokenizer", default="default", help="model whose tokenizer counts (hub id, folder or 'default')")
    ap.add_argument("--texts", nargs="+", required=True,
                    help="JSONL files of texts (FILE:FIELD picks a field; default 'text'), e.g. target responses")
    ap.add_argument("--out", required=True, help="token list to write (.safetensors)")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer, "draft"))
    path, counts = build_token_list(tok, args.texts, args.out)
    print(f"{path}: {len(counts)} distinct tokens, {sum(counts.values())} counted")
    return 0


def _datagen_features(argv: list[str]) -> int:
    """adaptive-spec datagen-features: complete a datagen run stored without features (e.g. the
    committed data/datagen/mix) with the draft's hidden states, into a folder that training,
    autotune and eval/ablate_heads.py read (datagen_features.py)."""
    from .datagen_features import run

    ap = _Parser(prog="adaptive-spec datagen-features", description=_datagen_features.__doc__)
    ap.add_argument("--data", required=True, help="datagen folder whose shards have no features (e.g. data/datagen/mix)")
    ap.add_argument("--out", required=True, help="folder for the complete run with features (e.g. runs/datagen/mix)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="compute dtype (auto: bf16 on a GPU or a CPU with bf16 kernels, else fp32)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--prefix", default="mixed", choices=("mixed", "target"),
                    help="the prefix the states are computed on: mixed = the token-mixed response (x, Z), the "
                         "paper's; target = the target's own response, e(x, X_<i, Y_i) and e(x, X_<i) at every "
                         "position, the inputs a head gets when decoding (features.py)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    run(a.data, a.out, a.dtype, a.device, a.threads, not a.no_progress, a.prefix)
    return 0


def _autotune(argv: list[str]) -> int:
    """adaptive-spec autotune: replay an acceptance head on the dev responses of a datagen run and
    save the expected counts per threshold h and per fixed K beside the head (threshold_curve.json:
    machine-independent), which --threshold auto and --k auto turn into a pick for the running machine."""
    from .autotune import curve_table, make_curve

    ap = _Parser(prog="adaptive-spec autotune", description=_autotune.__doc__)
    ap.add_argument("--head", default=None, help="acceptance head folder (omit for the per-K curve only, with --out)")
    ap.add_argument("--data", required=True, help="datagen folder (manifest.json + shards) with stored features")
    ap.add_argument("--split", default="dev", help="datagen split to replay (default dev)")
    ap.add_argument("--k-max", type=int, default=20, help="hard cap on candidates per round, as in decoding (20)")
    ap.add_argument("--out", default=None, help="curve file to write (default <head>/threshold_curve.json)")
    args = ap.parse_args(argv)
    path, curve = make_curve(args.head, args.data, args.split, args.k_max, args.out)
    print(curve_table(curve))
    print(f"\n{path}: {curve['n_responses']} responses, {curve['n_tokens']} tokens of {args.data} ({args.split})")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    if argv and argv[0] == "datagen-features":
        return run_main(_datagen_features, argv[1:], "finished shards are kept; rerun the same command to resume")
    if argv and argv[0] == "draft-vocab":
        return run_main(_draft_vocab, argv[1:], "nothing was written; run the same command again")
    if argv and argv[0] == "autotune":
        return run_main(_autotune, argv[1:], "no curve was written; run the same command again")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad argument (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    return run_main(lambda _: _generate(args), None, "no output beyond what was printed; nothing to resume")


if __name__ == "__main__":
    sys.exit(main())
