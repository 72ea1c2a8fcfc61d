"""One configuration of a sweep on one prompt: its policy, completed with what only the loaded sweep knows,
run and counted. Part of `adaptive-spec sweep` (sweep.py runs the grid)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.utils import is_sklearn_available
from transformers.utils import logging as hf_logging

from ..decoding.metrics import Metrics
from ..decoding.interfaces import PolicyContext
from ..decoding.pipeline import make_policy
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..heads.curve import load_curve
from ..params import LearnedParams, OracleParams
from ..timing import timed
from .sweep_config import SweepConfig
from .sweep_grid import Baseline, Configuration, Source, completed
from .tree_calibration import VERIFICATION

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented prompt-lookup setting (it has no default)


@dataclass
class Sweep:
    """A sweep as it runs: what its steps and every run share, held in one place instead of passed along."""

    cfg: SweepConfig
    grid: list[Configuration]
    notes: list[str]
    heads: dict  # label (or a trees entry's folder as written) -> (AcceptanceHead, info)
    out: Path | None = None
    settings: dict = field(default_factory=dict)  # what the results depend on (sweep._settings)
    pairs: dict = field(default_factory=dict)  # drafts entry ("" without a drafts axis) -> (pair, draft-alone decoder)
    tree_ctx: dict = field(default_factory=dict)  # the trees' calibrated rates and node cost (sweep._tree_context)
    greedy: dict = field(default_factory=dict)  # prompt ids -> the target alone's greedy output: the oracle's X

    def first_pair(self):
        """The first `drafts` entry's pair: every pair shares its target."""
        return next(iter(self.pairs.values()))[0]

    def pair_of(self, conf: Configuration) -> tuple:
        """(pair, draft-alone decoder) of the configuration's `drafts` entry (the first without one)."""
        return self.pairs[next(iter(self.pairs)) if conf.draft is None else conf.draft]


def hf_generate(pair, ids: list[int], cfg, seed: int, max_new_tokens: int, lookup: bool = False):
    """transformers' assisted generation (its default candidate schedule), or with `lookup` its prompt
    lookup (n-gram candidates, no draft model), timed like ours: (Metrics, stopped_by, new ids).
    `cfg`: anything with temperature, top_k, top_p (a SweepConfig)."""
    tm = pair.target.model
    counts = {"target": 0, "draft": 0}
    hooks = [tm.register_forward_pre_hook(lambda m, a: counts.__setitem__("target", counts["target"] + 1))]
    if not lookup:
        hooks.append(pair.draft.model.register_forward_pre_hook(
            lambda m, a: counts.__setitem__("draft", counts["draft"] + 1)))
    x = torch.tensor([ids], dtype=torch.long, device=pair.target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=cfg.temperature > 0, repetition_penalty=1.0,
              eos_token_id=list(pair.eos_token_ids),
              pad_token_id=pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None
              else pair.eos_token_ids[0])
    if cfg.temperature > 0:
        kw.update(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        torch.manual_seed(seed)
        peer = ({"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if lookup
                else {"assistant_model": pair.draft.model})
        with torch.inference_mode(), timed(x.device) as t:
            out = tm.generate(x, attention_mask=torch.ones_like(x), **peer, **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
        for h in hooks:
            h.remove()
    new = out[0, len(ids):].tolist()
    n = len(new)
    m = Metrics(n_tokens=n, n_draft_forwards=counts["draft"], n_target_forwards=counts["target"], wall_s=t.s)
    # one target pass per round, one draft pass per candidate: N_draft + N_target = N + N_discarded (prompt
    # lookup drafts without forwards: its discarded candidates are not counted, only those accepted)
    m.n_discarded = 0 if lookup else max(0, m.n_draft_forwards + m.n_target_forwards - n)
    m.n_accepted = max(0, n - m.n_target_forwards)
    m.n_drafted = m.n_accepted + m.n_discarded
    stopped = "eos" if new and new[-1] in set(pair.eos_token_ids) else "length"
    return m, stopped, new


def hf_schedule_note(draft_model) -> str:
    """What transformers' assisted generation will do with this draft (its defaults unless the draft's
    generation_config sets them)."""
    gc = draft_model.generation_config
    defaults = gc._get_default_generation_params() if hasattr(gc, "_get_default_generation_params") else {}
    get = lambda k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k)  # noqa: E731
    adapt = "on" if is_sklearn_available() else "off (transformers adapts it only when scikit-learn is installed)"
    return (f"hf_assisted: num_assistant_tokens {get('num_assistant_tokens')}, schedule "
            f"{get('num_assistant_tokens_schedule')}, assistant_confidence_threshold "
            f"{get('assistant_confidence_threshold')}, threshold adaptation {adapt}")


def run_one(sweep: Sweep, conf: Configuration, ids: list[int], seed: int, max_new_tokens: int | None = None):
    """(Metrics, stopped_by, new token ids, extra row fields) of one configuration on one prompt; the oracle's
    X is the target alone's greedy output on this prompt where it ran first (sweep.greedy)."""
    cfg = sweep.cfg
    pair, draft_decoder = sweep.pair_of(conf)
    samp = dict(max_new_tokens=max_new_tokens or cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                top_p=cfg.top_p, seed=seed)
    if conf.policy is Baseline.DRAFT_AR:
        return _run_draft_alone(draft_decoder, ids, samp)
    if isinstance(conf.policy, Baseline):
        return _run_peer(pair, conf.policy, ids, cfg, samp)
    if conf.source is Source.TREES:
        return _run_tree(sweep, conf, pair, ids, samp)
    g = pair.generate(ids, policy=_policy(sweep, conf, pair, ids), **samp)
    pick = getattr(g, "auto", None)
    extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"]} if pick else {}
    if pick and conf.source is Source.SHORTHAND:
        extra.update(auto_predicted_wall_tokens_per_s=pick.get("wall_tokens_per_s"), auto_time_model=pick["model"],
                     auto_k_max=pick.get("k_max"))
    return g.metrics, g.stopped_by, g.token_ids, extra


def _run_peer(pair, baseline: Baseline, ids: list[int], cfg: SweepConfig, samp: dict):
    """transformers' own assisted generation or prompt lookup."""
    lookup = baseline is Baseline.HF_PROMPT_LOOKUP
    return (*hf_generate(pair, ids, cfg, samp["seed"], samp["max_new_tokens"], lookup=lookup), {})


def _run_draft_alone(draft_decoder, ids: list[int], samp: dict):
    """The draft model alone, as the decoder's target: its forwards counted as the draft's."""
    g = draft_decoder.generate(ids, max_new_tokens=samp["max_new_tokens"], seed=samp["seed"],
                               sampling=SamplingParams(samp["temperature"], samp["top_k"], samp["top_p"]))
    m = g.metrics  # the draft ran as the decoder's "target": move its counts to the draft's fields
    m.n_draft_forwards, m.draft_s = m.n_target_forwards, m.target_s
    m.n_target_forwards, m.target_s = 0, 0.0
    return m, g.stopped_by, g.token_ids, {}


def _policy(sweep: Sweep, conf: Configuration, pair, ids: list[int]):
    """The configuration's policy as generate takes it: a `policies` entry as given (with auto_prompts' curve where
    it reads auto); a shorthand with its loaded head, its auto's curve and the oracle's X."""
    if conf.source is Source.POLICIES:
        if sweep.cfg.auto_prompts and conf.reads_auto():
            return completed(conf.policy, curve=_curve(sweep, conf, pair))
        return conf.policy
    more = {}
    if conf.head is not None:
        more["head"] = sweep.heads[conf.head][0]
    if isinstance(conf.policy, OracleParams):
        more["target_output"] = sweep.greedy.get(tuple(ids))
    if conf.reads_auto():
        more["curve"] = _curve(sweep, conf, pair)
    return completed(conf.policy, **more)


def _curve(sweep: Sweep, conf: Configuration, pair) -> str:
    """The curve an auto configuration picks from: with auto_prompts, the one of those prompts' answers (for its
    head: a policies entry's folder, a learned shorthand's, or for ks the first head's); else its head's, and for
    ks `curve` or the first head's (auto_curve)."""
    cfg, heads = sweep.cfg, sweep.heads
    if conf.source is Source.POLICIES:
        head = getattr(conf.policy, "head", None)
        return prompts_curve(pair, cfg, str(head) if head else None)
    label = conf.head if conf.head is not None else next(iter(heads), None)
    if cfg.auto_prompts:
        return prompts_curve(pair, cfg, heads[label][1]["path"] if label is not None else None)
    return heads[conf.head][1]["path"] if conf.head is not None else auto_curve(cfg, heads)


def prompts_curve(pair, cfg: SweepConfig, head_dir: str | None) -> str:
    """The curve of auto_prompts' answers for a head (auto.measure_prompts: recorded by the loaded pair once,
    cached, and remembered on the pair, so every run of the sweep reads the same file)."""
    from ..decoding.auto import load_texts, measure_prompts

    memo = getattr(pair, "prompts_curves", None)
    if memo is None:
        memo = pair.prompts_curves = {}
    key = (cfg.auto_prompts, head_dir, cfg.temperature, cfg.k_max)
    if key not in memo:
        made = measure_prompts(pair, None, head_dir, cfg.temperature, texts=load_texts(cfg.auto_prompts),
                               k_max=cfg.k_max)
        if made["curve_file"] is None:
            raise UserError(f"auto_prompts {cfg.auto_prompts}: no curve was made (no draft model recorded)")
        memo[key] = made["curve_file"]
    return memo[key]


def auto_curve(cfg: SweepConfig, heads: dict) -> str:
    """The curve `ks: [auto]` picks from: `curve`, else the one beside the first head."""
    return cfg.curve or next(iter(heads.values()))[1]["path"]


def check_auto_curves(cfg: SweepConfig, heads: dict, grid: list[Configuration]):
    """Every curve a shorthand auto needs exists and fits, checked before the models load;
    the error names the config key and the command that makes the curve. With auto_prompts the curves are
    made once the pair has loaded (run_one), from those prompts' answers: there is nothing to check yet."""
    if cfg.auto_prompts:
        return
    for conf in grid:
        if conf.source is not Source.SHORTHAND or not conf.reads_auto():
            continue
        learned = isinstance(conf.policy, LearnedParams)
        key, need = ("thresholds", "h") if learned else ("ks", "k")
        source = heads[conf.head][1]["path"] if learned else auto_curve(cfg, heads)
        try:
            curve = load_curve(source, need, source if learned else None)
        except UserError as e:
            raise UserError(f"config key '{key}' lists auto: {e}") from None
        if learned and curve["k_max"] != cfg.k_max:
            raise UserError(f"config key 'thresholds' lists auto, but the curve beside {source} was made with "
                            f"k_max {curve['k_max']}, not the sweep's k_max {cfg.k_max}; set k_max: "
                            f"{curve['k_max']}, or rerun autotune with --k-max {cfg.k_max}")


def verification(conf: Configuration) -> str | None:
    """The verification whose calibrated rates a `trees` configuration starts from (None: it reads none)."""
    return VERIFICATION.get(conf.policy.name) if conf.source is Source.TREES else None


def auto_node_cost(conf: Configuration) -> bool:
    """A `trees` configuration with a learned budget whose node cost the sweep measures (unset)."""
    return verification(conf) is not None and conf.policy.tree_learned and conf.policy.tree_node_cost is None


def reads_costs(conf: Configuration) -> bool:
    """Whether it reads the sweep's pinned forward times: an auto shorthand, a measured node cost, any
    `policies` entry (its policy may pick per machine)."""
    shorthand_auto = conf.source is Source.SHORTHAND and conf.reads_auto()
    return conf.source is Source.POLICIES or auto_node_cost(conf) or shorthand_auto


def _run_tree(sweep: Sweep, conf: Configuration, pair, ids: list[int], samp: dict):
    """run_one for a `trees` configuration: its settings, as generate takes them, with the head loaded
    and the sweep's calibrated rates (and measured node cost). A fresh policy per run, starting from
    those rates, which adapt within the run only where adapt_rates says so: no run depends on
    what ran before it."""
    more, extra, ctx = {}, {}, sweep.tree_ctx
    if verification(conf) is not None:
        if conf.head is not None:
            more["head"] = sweep.heads[conf.head][0]
        more["tree_rates"] = ctx["rates"][verification(conf)]
        extra["tree_calibration"] = ctx.get("calibration")
        if auto_node_cost(conf):
            more["tree_node_cost"] = ctx.get("node_cost")
        if conf.policy.tree_learned:
            extra["node_cost"] = float(more.get("tree_node_cost", conf.policy.tree_node_cost))
    pol = make_policy(completed(conf.policy, **more), PolicyContext(pair))
    sampling = SamplingParams(samp["temperature"], samp["top_k"], samp["top_p"])
    g = pair.decoder.generate(ids, max_new_tokens=samp["max_new_tokens"], sampling=sampling, policy=pol,
                              seed=samp["seed"])
    return g.metrics, g.stopped_by, g.token_ids, {**tree_stats(pol, g.metrics), **extra}


def tree_stats(pol, m) -> dict:
    """Per-round means of a tree or multi-draft generation: drafted tokens (Metrics), the drafted
    tree's depth and the predicted accepted tokens (sum of R) where the policy keeps them (None
    where it does not)."""
    rounds = sum(m.accepted_hist.values()) or m.n_target_forwards
    n = max(getattr(pol, "rounds", rounds), 1)
    out = {"rounds": rounds, "drafted_per_round": m.n_drafted / max(rounds, 1)}
    for key, stat in (("tree_depth", "depth_sum"), ("predicted_accepted", "predicted")):
        v = getattr(pol, stat, None)
        out[key] = None if v is None else v / n
    return out
