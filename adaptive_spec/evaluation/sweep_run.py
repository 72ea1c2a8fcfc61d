"""One configuration of a sweep on one prompt: its policy built from the typed settings `generate`
takes (params.py), run and counted. Part of `adaptive-spec sweep` (sweep.py runs the grid)."""
from __future__ import annotations

import torch
from transformers.utils import is_sklearn_available
from transformers.utils import logging as hf_logging

from ..decoding.decoder import Metrics
from ..decoding.interfaces import PolicyContext
from ..decoding.pipeline import make_policy
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..heads.curve import load_curve
from ..params import policy_params
from ..timing import timed
from .sweep_grid import AUTO, RunSpec, SweepConfig, tree_params
from .tree_calibration import VERIFICATION

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented prompt-lookup setting (it has no default)


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


def run_one(pair, spec: RunSpec, ids: list[int], cfg: SweepConfig, seed: int, heads: dict, draft_decoder,
            max_new_tokens: int | None = None, target_output: list[int] | None = None, tree_ctx: dict | None = None):
    """(Metrics, stopped_by, new token ids, extra row fields) of one configuration on one prompt.
    `target_output`: the target's greedy output on this prompt, when known, for the oracle (saves a
    decode); `tree_ctx`: the calibrated rates and node cost of the tree policies (sweep._tree_context)."""
    mnt = max_new_tokens or cfg.max_new_tokens
    samp = dict(max_new_tokens=mnt, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
    if tree_params(spec) is not None:
        return _run_tree(pair, spec, ids, samp, heads, tree_ctx or {})
    if "settings_obj" in spec.params:  # a `policies` entry: the settings generate takes
        g = pair.generate(ids, policy=_policy_entry(pair, spec, cfg), **samp)
        pick = getattr(g, "auto", None)
        extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"]} if pick else {}
        return g.metrics, g.stopped_by, g.token_ids, extra
    if spec.method in ("hf_assisted", "hf_prompt_lookup"):
        return (*hf_generate(pair, ids, cfg, seed, mnt, lookup=spec.method == "hf_prompt_lookup"), {})
    if spec.method == "draft_ar":
        g = draft_decoder.generate(ids, max_new_tokens=mnt, seed=seed,
                                   sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p))
        m = g.metrics  # the draft ran as the decoder's "target": move its counts to the draft's fields
        m.n_draft_forwards, m.draft_s = m.n_target_forwards, m.target_s
        m.n_target_forwards, m.target_s = 0, 0.0
        return m, g.stopped_by, g.token_ids, {}
    own = None
    if cfg.auto_prompts and spec.method in ("fixed_auto", "learned_auto"):
        label = spec.params["head"] if spec.method == "learned_auto" else next(iter(heads), None)
        own = prompts_curve(pair, cfg, heads[label][1]["path"] if label is not None else None)
    g = pair.generate(ids, policy=chain_params(spec, cfg, heads, target_output, own), **samp)
    pick = getattr(g, "auto", None)
    extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"],
             "auto_predicted_wall_tokens_per_s": pick.get("wall_tokens_per_s"),
             "auto_time_model": pick["model"], "auto_k_max": pick.get("k_max")} if pick else {}
    return g.metrics, g.stopped_by, g.token_ids, extra


# a chain configuration's sweep keys -> its policy's settings (params.py); `_auto` reads a curve
_SETTINGS = {
    "ar": lambda p, cfg, heads, x: {},
    "heuristic": lambda p, cfg, heads, x: {"k_max": cfg.k_max},
    "oracle": lambda p, cfg, heads, x: {"target_output": x},
    "fixed": lambda p, cfg, heads, x: {"k": p["k"]},
    "fixed_auto": lambda p, cfg, heads, x: {"k": p["k"], "curve": auto_curve(cfg, heads)},
    "learned": lambda p, cfg, heads, x: {"head": heads[p["head"]][0], "threshold": p["h"], "k_max": cfg.k_max},
    "learned_auto": lambda p, cfg, heads, x: {"head": heads[p["head"]][0], "threshold": p["h"], "k_max": cfg.k_max,
                                              "curve": heads[p["head"]][1]["path"]},
    "confidence": lambda p, cfg, heads, x: {"threshold": p["tau"], "k_max": cfg.k_max},
    "entropy": lambda p, cfg, heads, x: {"threshold": p["tau"], "k_max": cfg.k_max},
}


def chain_params(spec: RunSpec, cfg: SweepConfig, heads: dict, target_output: list[int] | None = None,
                 curve: str | None = None):
    """The typed settings of a chain configuration, built and checked by its policy's registered
    params class: the sweep reaches policies by the names and settings generate uses. `curve`: the
    curve an auto configuration picks from instead (auto_prompts')."""
    settings = _SETTINGS[spec.method](spec.params, cfg, heads, target_output)
    if curve is not None:
        settings["curve"] = curve
    return policy_params(spec.method.removesuffix("_auto"), **settings)


def prompts_curve(pair, cfg: SweepConfig, head_dir: str | None) -> str:
    """The curve of auto_prompts' answers for a head (probe_prompts.measure: recorded by the loaded pair once,
    cached, and remembered on the pair, so every run of the sweep reads the same file)."""
    from .probe_prompts import load_texts, measure

    memo = getattr(pair, "prompts_curves", None)
    if memo is None:
        memo = pair.prompts_curves = {}
    key = (cfg.auto_prompts, head_dir, cfg.temperature, cfg.k_max)
    if key not in memo:
        made = measure(pair, None, head_dir, cfg.temperature, texts=load_texts(cfg.auto_prompts), k_max=cfg.k_max)
        if made["curve_file"] is None:
            raise UserError(f"auto_prompts {cfg.auto_prompts}: no curve was made (no draft model recorded)")
        memo[key] = made["curve_file"]
    return memo[key]


def _policy_entry(pair, spec: RunSpec, cfg: SweepConfig):
    """A `policies` entry's settings; where one reads auto and the sweep has auto_prompts, with their curve."""
    obj, settings = spec.params["settings_obj"], spec.params["settings"]
    if not cfg.auto_prompts or AUTO not in (settings.get("threshold"), settings.get("k")):
        return obj
    head = settings.get("head")
    return policy_params(obj.name, **{**settings, "curve": prompts_curve(pair, cfg, str(head) if head else None)})


def auto_curve(cfg: SweepConfig, heads: dict) -> str:
    """The curve `ks: [auto]` picks from: `curve`, else the one beside the first head."""
    return cfg.curve or next(iter(heads.values()))[1]["path"]


def check_auto_curves(cfg: SweepConfig, heads: dict, specs: list[RunSpec]):
    """Every curve an auto configuration needs exists and fits, checked before the models load;
    the error names the config key and the command that makes the curve. With auto_prompts the curves are
    made once the pair has loaded (run_one), from those prompts' answers: there is nothing to check yet."""
    if cfg.auto_prompts:
        return
    for spec in specs:
        key, need, source = (("thresholds", "h", heads[spec.params["head"]][1]["path"])
                             if spec.method == "learned_auto" else ("ks", "k", auto_curve(cfg, heads))
                             if spec.method == "fixed_auto" else (None, None, None))
        if key:
            try:
                curve = load_curve(source, need, source if need == "h" else None)
            except UserError as e:
                raise UserError(f"config key '{key}' lists auto: {e}") from None
            if need == "h" and curve["k_max"] != cfg.k_max:
                raise UserError(f"config key 'thresholds' lists auto, but the curve beside {source} was made with "
                                f"k_max {curve['k_max']}, not the sweep's k_max {cfg.k_max}; set k_max: "
                                f"{curve['k_max']}, or rerun autotune with --k-max {cfg.k_max}")


def auto_node_cost(spec: RunSpec) -> bool:
    """A `trees` configuration with a learned budget whose node cost the sweep measures (unset)."""
    p = tree_params(spec)
    return p is not None and spec.method in VERIFICATION and p.tree_learned and p.tree_node_cost is None


def _run_tree(pair, spec: RunSpec, ids: list[int], samp: dict, heads: dict, ctx: dict):
    """run_one for a `trees` configuration: its settings, as generate takes them, with the head loaded
    and the sweep's calibrated rates (and measured node cost). A fresh policy per run, starting from
    those rates, which adapt within the run only where adapt_rates says so: no run depends on
    what ran before it."""
    settings = dict(spec.params["tree"])
    extra = {}
    if spec.method in VERIFICATION:
        if settings.get("head") is not None:
            settings["head"] = heads[settings["head"]][0]
        settings["tree_rates"] = ctx["rates"][VERIFICATION[spec.method]]
        extra["tree_calibration"] = ctx.get("calibration")
        if auto_node_cost(spec):
            settings["tree_node_cost"] = ctx.get("node_cost")
        if tree_params(spec).tree_learned:
            extra["node_cost"] = float(settings["tree_node_cost"])
    pol = make_policy(policy_params(spec.method, **settings), PolicyContext(pair))
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
