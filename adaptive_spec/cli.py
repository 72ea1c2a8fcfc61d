"""`adaptive-spec` command line: fetch-models, generate, datagen, datagen-features, train, autotune, sweep, report, probe."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from . import params, typed
from .backends.paths import resolve_model_path
from .cli_args import Parser, add_fields, flag, set_fields
from .errors import UserError, run_main
from .typed import PolicyParams, SamplingParams

# torch, transformers and the decoder load only once every check has passed (validate), so a mistake is
# refused in a second or two, before any of them

# subcommands with their own argument parsers: everything after the name is theirs
DELEGATED = {
    "fetch-models": ("adaptive_spec.setup.fetch", "build the default model pair into the local cache"),
    "datagen": ("adaptive_spec.datagen.generate", "generate token-mixed acceptance data for training heads"),
    "datagen-drafter": ("adaptive_spec.datagen.feature_rounds", "acceptance data for a head on a feature drafter, "
                        "from simulated rounds along its states"),
    "train": ("adaptive_spec.training.train", "train acceptance heads on datagen output (also: train.py)"),
    "sweep": ("adaptive_spec.evaluation.sweep", "threshold / K sweeps over prompt sets"),
    "report": ("adaptive_spec.evaluation.report", "tables and Pareto plots from sweep results"),
    "probe": ("adaptive_spec.evaluation.probe", "what pays on this machine: its costs measured once (cached), "
              "tok/s predicted per configuration, with the reason"),
}


def version() -> str:
    try:
        return dist_version("adaptive_spec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _add_generate(sub):
    # allow_abbrev off: --thresh must not quietly stand for --threshold (nor a misspelling for something else)
    g = sub.add_parser("generate", help="generate text with a draft/target pair", allow_abbrev=False,
                       description="Generate from the target, speculatively drafting with the draft model.")
    names = typed.policy_names()
    add_fields(g, params.PairParams.model_fields, lambda key: "")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--policy", default="fixed", type=_policy_name, metavar="POLICY",
                   help=f"stop policy: {', '.join(names)} (ar = target only; default fixed)")
    add_fields(g, typed.policy_fields(), lambda key: f" (policies: {', '.join(typed.policies_with(key))})")
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--auto-prompts", default=None, metavar="FILE|SET",
                   help="--threshold auto / --k auto pick from the acceptance on these prompts (a .jsonl file with a "
                        "'prompt' field a line, or a prompt set's name; a few short answers are generated on them "
                        "first, cached as adaptive-spec probe --prompts caches them) instead of the curve's (or "
                        "--curve's) dev answers")


def _policy_name(name: str) -> str:
    try:
        return typed.policy_class(name).name
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_sampling_args(g):
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, >= 0 (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, >= 0 (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate, >= 1")
    g.add_argument("--seed", type=int, default=0, help="random seed of the sampling")


@dataclass(frozen=True)
class Request:
    """`generate`'s arguments typed once (validate). With --auto-prompts, `auto_texts` are their prompts and
    `settings` the policy's settings as given: their curve exists only once the pair has loaded."""

    pair: params.PairParams
    policy: PolicyParams
    sampling: SamplingParams
    prompt: str
    max_new_tokens: int
    seed: int
    chat: bool
    json: bool
    auto_texts: tuple | None = None
    settings: dict = field(default_factory=dict)


def validate(args) -> Request:
    """Every check that needs no model, before gigabytes of weights load: the arguments as one Request,
    each setting checked by its params class, once."""
    if not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text with --prompt")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    given = set_fields(args, typed.policy_fields())
    checked, texts = _auto_prompts(args.auto_prompts, given)
    pair = params.pair_params(spell=flag, **set_fields(args, params.PairParams.model_fields))
    policy = params.policy_params(args.policy, spell=flag, **checked)
    if not policy.needs.draft_model:  # no draft model to load (ar; ngram without a fallback)
        pair = pair.model_copy(update={"draft": None})
    elif pair.draft is None:
        raise UserError(f"--policy {policy.name} drafts with a draft model, but --draft is none; name a draft (default: "
                        "the default pair's), or use --policy ngram (copies from the context, no draft model)")
    policy.check_sampling(sampling.temperature)
    params.check_runs_on(policy, pair.engine)
    pair.engine.check_available(pair.device)  # a GPU this torch cannot reach: refused before the weights
    if pair.draft is not None and pair.engine.model_files == "hf":  # a draft's vocabulary size is in its config.json
        pair.check_draft_vocab_size()
    return Request(pair, policy, sampling, args.prompt, args.max_new_tokens, args.seed, args.chat, args.json,
                   texts, given)


# what stands for auto while the rest of the policy is checked: with --auto-prompts its curve is made once the
# pair has loaded, so no curve exists to check yet
_AUTO_STAND_IN = {"threshold": 0.5, "k": 1}


def _auto_prompts(spec, given: dict) -> tuple[dict, tuple | None]:
    """(the policy's settings to check now, --auto-prompts' prompts or None): the prompts are read and checked
    here, before any model loads, and auto is checked with a stand-in until their curve exists."""
    if spec is None:
        return given, None
    if "auto" not in (given.get("threshold"), given.get("k")):
        raise UserError("--auto-prompts is read by --threshold auto and --k auto only; pass one of them, or drop it")
    from .decoding.auto import load_texts  # the probe's recording: loaded when it runs

    stand_ins = {k: _AUTO_STAND_IN[k] if v == "auto" and k in _AUTO_STAND_IN else v for k, v in given.items()}
    return stand_ins, load_texts(spec)


def _auto_policy(request: Request, pair) -> PolicyParams:
    """The policy as given, its auto reading the curve of --auto-prompts' answers (recorded by the loaded pair
    and cached, as adaptive-spec probe --prompts caches them) as it reads --curve."""
    from .decoding.auto import measure_prompts

    own = measure_prompts(pair, request.auto_texts, getattr(request.policy, "head", None),
                          request.sampling.temperature)["curve_file"]
    return params.policy_params(request.policy.name, spell=flag, **{**request.settings, "curve": own})


def _generate(args) -> int:
    request = validate(args)
    from transformers.utils import logging as hf_logging

    from .decoding.pipeline import SpecPair

    hf_logging.disable_progress_bar()  # weight-loading bars would drown the streamed text
    pair = SpecPair.load(request.pair)
    policy = request.policy if request.auto_texts is None else _auto_policy(request, pair)
    stream = None if request.json else (lambda s: print(s, end="", flush=True))
    sampling = request.sampling
    g = pair.generate(request.prompt, policy=policy, max_new_tokens=request.max_new_tokens,
                      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=request.seed,
                      chat=request.chat, on_text=stream)
    _print_result(g, request, pair.runtime_info())
    return 0


def _print_result(g, request: Request, runtime: dict):
    m = g.metrics
    if not request.json:
        print()
        print(f"[{request.policy.name}] {m.summary()}", file=sys.stderr)
        return
    metrics = {k: getattr(m, k) for k in ("n_tokens", "n_draft_forwards", "n_target_forwards", "n_discarded",
                                           "discard_rate", "verification_rate", "acceptance_rate", "wall_s")}
    metrics.update({k: v for k, v in m.to_dict().items() if k not in metrics})
    print(json.dumps({"text": g.text, "token_ids": g.token_ids, "metrics": metrics, "policy": request.policy.name,
                      "stopped_by": g.stopped_by, "auto": getattr(g, "auto", None), "runtime": runtime}, default=str))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="adaptive-spec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="what to run")
    _add_generate(sub)
    for name, (_, help_, *_) in {**DELEGATED, **LOCAL}.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _delegate(name: str, argv: list[str]) -> int:
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
    from transformers import AutoTokenizer  # heavy: the tokenizer registry, for this subcommand only

    ap = Parser(prog="adaptive-spec draft-vocab", description=_draft_vocab.__doc__)
    ap.add_argument("--tokenizer", default="default", help="model whose tokenizer counts (hub id, folder or 'default')")
    ap.add_argument("--texts", nargs="+", required=True,
                    help="JSONL files of texts (FILE:FIELD picks a field; default 'text'), e.g. target responses")
    ap.add_argument("--out", required=True, help="token list to write (.safetensors)")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer, "draft"))
    from .backends.vocab import build_token_list

    path, counts = build_token_list(tok, args.texts, args.out)
    print(f"{path}: {len(counts)} distinct tokens, {sum(counts.values())} counted")
    return 0


def _datagen_features(argv: list[str]) -> int:
    """adaptive-spec datagen-features: complete a datagen run stored without features (e.g. the
    committed data/datagen/mix) with the draft's hidden states, into a folder that training,
    autotune and `eval/score_heads.py ablate` read (datagen/features.py)."""
    from .datagen.features import run  # a subcommand's module: loaded when it runs, as DELEGATED's are

    ap = Parser(prog="adaptive-spec datagen-features", description=_datagen_features.__doc__)
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
    from .training.autotune import curve_table, make_curve  # a subcommand's module, as above

    ap = Parser(prog="adaptive-spec autotune", description=_autotune.__doc__)
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


# subcommands run here, each with its own parser: (function, help, what an interruption leaves)
LOCAL = {
    "datagen-features": (_datagen_features, "derive the draft's hidden states for a datagen run stored without them",
                         "finished shards are kept; rerun the same command to resume"),
    "draft-vocab": (_draft_vocab, "count token frequencies for a reduced draft vocabulary (--draft-vocab)",
                    "nothing was written; run the same command again"),
    "autotune": (_autotune, "predict throughput per threshold h and per K from a head and dev data (for "
                 "--threshold auto / --k auto)", "no curve was written; run the same command again"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    if argv and argv[0] in LOCAL:
        run, _, interrupted = LOCAL[argv[0]]
        return run_main(run, argv[1:], interrupted)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad argument (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    return run_main(lambda _: _generate(args), None, "no output beyond what was printed; nothing to resume")


if __name__ == "__main__":
    sys.exit(main())
