"""The sweep's loaded pairs and the jobs run on them, each row appended as it is done: one configuration on one
prompt, its policy completed once with what only the loaded sweep knows (heads, curves, calibrated rates, pinned
costs), run and counted. Part of `adaptive-spec sweep` (sweep.py runs its stages)."""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.utils import is_sklearn_available
from transformers.utils import logging as hf_logging

from ..decoding.auto import load_texts, measure_prompts
from ..decoding.metrics import Metrics
from ..decoding.pipeline import SpecPair
from ..decoding.replay import TraceRecorder
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..params import ARParams, OracleParams, PairParams
from ..timing import timed
from ..typed import PolicyParams, build
from .sweep_calibration import Calibrated, auto_node_cost, verification
from .sweep_files import Job, SweepFolder
from .sweep_grid import PEERS, Baseline, Configuration, Source, auto_curve

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented prompt-lookup setting (it has no default)


@dataclass(frozen=True)
class RunSettings:
    """What every run of the sweep shares (Runner), from the config."""

    sampling: SamplingParams
    max_new_tokens: int
    k_max: int  # hard cap on candidates per round of the adaptive policies
    seed: int
    auto_prompts: str  # with curve: where an auto's curve comes from
    curve: str
    warmup: bool
    progress: bool
    record_trace: bool


class Runner:
    """The sweep's loaded pairs and what every run shares. `run` runs one configuration on one prompt: transformers'
    peers by their own generate, every other one through generate (the draft alone as a pair of its own)."""

    def __init__(self, pairs: dict, settings: RunSettings, heads: dict, calibrated: Calibrated):
        """`pairs`: load_pairs's; `heads`: label (or a trees entry's folder as written) -> (AcceptanceHead, info);
        `calibrated`: what every tree run starts from (sweep_calibration.calibrate)."""
        self.pairs, self.settings, self.heads, self.calibrated = pairs, settings, heads, calibrated
        self.greedy = {}  # prompt ids -> the target alone's greedy output: the oracle's X
        self.prompt_curves = {}  # (head folder) -> the curve of auto_prompts' answers (prompts_curve)
        self.ready = {}  # configuration key -> its policy completed for generate (_policy), made at its first run

    def run_all(self, grid: list[Configuration], todo: list[Job], n_jobs: int, folder: SweepFolder) -> None:
        """Run each job on its draft configuration's pair and append its row to the folder's results.jsonl as soon
        as it is done. With warmup, short untimed runs on the first job's prompt (_warmup_jobs) come first."""
        s = self.settings
        warm = _warmup_jobs(grid, todo[0]) if todo and s.warmup else []
        bar = tqdm(total=n_jobs, initial=n_jobs - len(todo), desc="sweep", unit="run", dynamic_ncols=True,
                   disable=not s.progress, file=sys.stderr)
        keep_x = any(isinstance(j.conf.policy, OracleParams) for j in todo)  # build_grid adds it only when greedy
        try:
            for i, job in enumerate(warm + todo):
                short = i < len(warm)  # a warmup run: seed 0, a few tokens, not recorded
                seed = 0 if short else s.seed * 100_003 + job.prompt_idx
                n = min(8, s.max_new_tokens) if short else None
                m, stopped, new, extra = self.run(job.conf, job.ids, seed, n)
                if short:
                    continue
                if isinstance(job.conf.policy, ARParams):
                    if keep_x:  # the oracle's X (Theorem 4.1), for its run on this prompt
                        self.greedy[tuple(job.ids)] = new
                    # the target's own response, for scoring other drafts on it (eval/bench_draft_vocab.py)
                    extra = {**extra, "prompt_ids": list(job.ids), "token_ids": list(new)}
                folder.append_row(job, seed, (m, stopped, new, extra))
                bar.update(1)
                bar.set_postfix_str(f"{Path(job.dataset).stem} #{job.prompt_idx} {job.conf.key} "
                                    f"{m.tokens_per_s:.1f} tok/s", refresh=False)
        finally:
            bar.close()

    def run(self, conf: Configuration, ids: list[int], seed: int, max_new_tokens: int | None = None):
        """(Metrics, stopped_by, new token ids, extra row fields) of one configuration on one prompt: transformers'
        peers by their own generate, every other configuration through generate with its policy completed
        (_policy), the draft alone as the target of a pair of its own (SpecPair.draft_alone). generate makes a fresh
        policy per run: a `trees` entry's rates start from the calibrated ones every run and adapt within it only
        where adapt_rates says so, so no run depends on what ran before it."""
        pair = self.pairs[next(iter(self.pairs)) if conf.draft is None else conf.draft]  # the first: no drafts entry
        n = max_new_tokens or self.settings.max_new_tokens
        s = self.settings.sampling
        if conf.policy in PEERS:
            return (*hf_generate(pair, ids, s, seed, n, lookup=conf.policy is Baseline.HF_PROMPT_LOOKUP), {})
        alone = conf.policy is Baseline.DRAFT_AR
        on, policy = (pair.draft_alone, ARParams()) if alone else (pair, self._policy(conf, pair, ids))
        trace = [TraceRecorder()] if self.settings.record_trace and not alone else []  # its row keeps the trace
        g = on.generate(ids, policy=policy, max_new_tokens=n, temperature=s.temperature, top_k=s.top_k,
                        top_p=s.top_p, seed=seed, extras=trace)
        if alone:  # the draft ran as the pair's "target": its counts move to the draft's fields
            m = g.metrics
            m.n_draft_forwards, m.draft_s = m.n_target_forwards, m.target_s
            m.n_target_forwards, m.target_s = 0, 0.0
        return g.metrics, g.stopped_by, g.token_ids, self._row_extra(conf, policy, g)

    def _row_extra(self, conf: Configuration, policy, g) -> dict:
        """The fields a generation of `policy` (completed) adds to its row: an auto's pick; a `trees` entry's
        per-round statistics, the calibration its rates came from and its node cost."""
        if conf.source is Source.TREES:
            extra = tree_stats(g.policy, g.metrics)
            if verification(conf) is not None:
                extra["tree_calibration"] = self.calibrated.calibration
                if policy.tree_learned:
                    extra["node_cost"] = float(policy.tree_node_cost)
            return extra
        pick = getattr(g, "auto", None)
        extra = {"auto_value": pick["value"], "auto_predicted_tokens_per_s": pick["tokens_per_s"]} if pick else {}
        if pick and conf.source is Source.SHORTHAND:
            extra.update(auto_predicted_wall_tokens_per_s=pick.get("wall_tokens_per_s"),
                         auto_time_model=pick["model"], auto_k_max=pick.get("k_max"))
        return extra

    def _policy(self, conf: Configuration, pair, ids: list[int]):
        """The configuration's policy as generate takes it, completed once (at its first run, self.ready) with what
        only the loaded sweep knows (_more); the oracle's at every run, with its X for this prompt."""
        policy = self.ready.get(conf.key)
        if policy is None:
            more = self._more(conf, pair, ids)
            given = conf.source is Source.POLICIES and not more  # a `policies` entry is complete as given
            policy = conf.policy if given else completed(conf.policy, **more)
            if not isinstance(policy, OracleParams):
                self.ready[conf.key] = policy
        return policy

    def _more(self, conf: Configuration, pair, ids: list[int]) -> dict:
        """What the configuration's policy takes from the loaded sweep: its loaded head; an auto's curve (a
        `policies` entry's only with auto_prompts); the oracle's X, the target alone's greedy output on this
        prompt; a `trees` entry's calibrated rates and measured node cost."""
        more, cal = {}, self.calibrated
        if conf.source is Source.TREES:
            if verification(conf) is None:  # multi-draft: nothing to add
                return more
            more["tree_rates"] = cal.rates[verification(conf)]
            if auto_node_cost(conf):
                more["tree_node_cost"] = cal.node_cost
        if conf.head is not None:
            more["head"] = self.heads[conf.head][0]
        if isinstance(conf.policy, OracleParams):
            more["target_output"] = self.greedy.get(tuple(ids))
        if conf.reads_auto and (conf.source is not Source.POLICIES or self.settings.auto_prompts):
            more["curve"] = self._curve(conf, pair)
        return more

    def _curve(self, conf: Configuration, pair) -> str:
        """The curve an auto configuration picks from: with auto_prompts, the one of those prompts' answers (for
        its head: a policies entry's folder, a learned shorthand's, or for ks the first head's); else its head's,
        and for ks `curve` or the first head's (auto_curve)."""
        heads = self.heads
        if conf.source is Source.POLICIES:
            head = getattr(conf.policy, "head", None)
            return self._prompts_curve(pair, str(head) if head else None)
        label = conf.head if conf.head is not None else next(iter(heads), None)
        if self.settings.auto_prompts:
            return self._prompts_curve(pair, heads[label][1]["path"] if label is not None else None)
        if conf.head is not None:
            return heads[conf.head][1]["path"]
        return auto_curve(self.settings.curve, [info["path"] for _, info in heads.values()])

    def _prompts_curve(self, pair, head_dir: str | None) -> str:
        """The curve of auto_prompts' answers for a head (auto.measure_prompts: recorded by the loaded pair
        once, cached, and remembered, so every run of the sweep reads the same file)."""
        s = self.settings
        if head_dir not in self.prompt_curves:
            made = measure_prompts(pair, load_texts(s.auto_prompts), head_dir, s.sampling.temperature, k_max=s.k_max)
            if made["curve_file"] is None:
                raise UserError(f"auto_prompts {s.auto_prompts}: no curve was made (no draft model recorded)")
            self.prompt_curves[head_dir] = made["curve_file"]
        return self.prompt_curves[head_dir]


def load_pairs(draft_pairs: dict[str, PairParams], heads: dict) -> dict:
    """drafts entry ("" without a drafts axis) -> its pair, every head checked against the draft and moved to its
    device. The pairs share the first one's target (SpecPair.load's share_target), so the target alone and every
    draft configuration run on the same weights and kernels."""
    hf_logging.disable_progress_bar()
    pairs = {}
    for d, params in draft_pairs.items():
        pair = pairs[d] = SpecPair.load(params, share_target=next(iter(pairs.values()), None))
        for label, (head, info) in heads.items():
            if head.hidden_size != pair.draft.hidden_size:
                raise UserError(f"head {label} at {info['path']} was trained for a draft of hidden size "
                                f"{head.hidden_size} but the draft in use has hidden size {pair.draft.hidden_size}; "
                                "pass the draft it was trained for or train a head for this draft")
            head.to(pair.draft.device)
    return pairs


def completed(policy: PolicyParams, **more) -> PolicyParams:
    """`policy` with settings only the loaded sweep knows (a head object, a curve), checked whole by its class."""
    given = {k: getattr(policy, k) for k in policy.model_fields_set}
    return build(type(policy), {**given, **more}, f"policy {policy.name}")


def _warmup_jobs(grid: list[Configuration], job: Job) -> list[Job]:
    """Untimed short generations on `job`'s prompt, one per kind (a row's method) and draft configuration: the
    first forwards pay for allocation and kernel selection."""
    kinds = {}
    for conf in grid:
        if not isinstance(conf.policy, OracleParams):
            kinds.setdefault((conf.row["method"], conf.draft), conf)
    return [job._replace(conf=conf) for conf in kinds.values()]


def hf_generate(pair, ids: list[int], sampling, seed: int, max_new_tokens: int, lookup: bool = False):
    """transformers' assisted generation (its default candidate schedule), or with `lookup` its prompt
    lookup (n-gram candidates, no draft model), timed like ours: (Metrics, stopped_by, new ids).
    `sampling`: anything with temperature, top_k, top_p (SamplingParams)."""
    tm = pair.target.model
    counts = Counter()  # forwards per role, by pre-hooks
    models = {"target": tm} if lookup else {"target": tm, "draft": pair.draft.model}
    hooks = [mod.register_forward_pre_hook(lambda m, a, r=role: counts.update([r])) for role, mod in models.items()]
    x = torch.tensor([ids], dtype=torch.long, device=pair.target.device)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=sampling.temperature > 0, repetition_penalty=1.0,
              eos_token_id=list(pair.eos_token_ids),
              pad_token_id=pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None
              else pair.eos_token_ids[0])
    if sampling.temperature > 0:
        kw.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
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
