"""The prompts a sweep runs on (PromptPicker: chosen once the pairs load, as they encode them), and what its runs
share that is measured once, after the pairs load, and pinned in its out_dir so that a resumed sweep reads the
same: the tree policies' acceptance rates (tree_calibration.json, measured by measure_rates on prompts no
configuration is evaluated on) and the forward times every auto pick reads (costs.json: ks / thresholds auto, a
learned tree budget's node cost). Measures says what a sweep needs (its plan's); `calibrate` measures it, or reads
it back. Part of `adaptive-spec sweep`."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..decoding.auto import measure_costs
from ..decoding.sampling import SamplingParams
from ..decoding.trees.policy import TreePolicy
from ..decoding.trees.shapes import PositionalRates
from ..errors import UserError
from ..runs import read_json, read_jsonl, settings_problem, write_json
from .sweep_files import COSTS, RESULTS, TREE_CALIBRATION, SweepFolder, prompt_sha, settings_hash
from .sweep_grid import Configuration, Source
from .tree_calibration import VERIFICATION

CALIBRATION_RUNS = (("batch", None), ("sequence", 4))  # (drafting, budget); None: the calibration width
CALIBRATION_SEED = 10_000  # far from the evaluation seeds, so no calibration run repeats an evaluated one


@dataclass(frozen=True)
class PromptPicker:
    """Which prompts a sweep takes: per dataset the first n_prompts of its shuffled texts that fit in
    max_prompt_tokens and, with max_new_tokens, in both models' context, as the pair encodes them; and
    `calibration` more per dataset, none evaluated, for the tree policies' rates (0: none)."""

    texts: dict  # dataset -> its shuffled texts
    max_prompt_tokens: int
    max_new_tokens: int
    chat: bool
    n_prompts: int
    calibration: int

    def choose(self, pair, note) -> tuple[dict, list]:
        """(dataset -> [(index in the shuffled set, text, ids)], the calibration prompts); what was skipped goes
        to `note`. The calibration prompts come from the END of each shuffled set, so they stay the same when
        n_prompts grows."""
        selected = {ds: self._dataset(pair, ds, note) for ds in self.texts}
        if not self.calibration:
            return selected, []
        prompts = []
        for ds, chosen in selected.items():
            used = {i for i, _, _ in chosen}
            order = [i for i in reversed(range(len(self.texts[ds]))) if i not in used]
            prompts += self._pick(pair, self.texts[ds], self.calibration, order)[0]
        return selected, prompts

    def _pick(self, pair, texts: list[str], n: int, order=None) -> tuple[list[tuple[int, str, list[int]]], int]:
        """The first n of the texts that fit, taken in `order` (indices; default: the shuffled order), and how
        many were skipped."""
        ctx = [m.max_length for m in (pair.target, pair.draft) if m is not None and m.max_length]
        limit = min([self.max_prompt_tokens] + [c - self.max_new_tokens for c in ctx])
        chosen, skipped = [], 0
        for i in range(len(texts)) if order is None else order:
            if len(chosen) == n:
                break
            ids = pair.encode(texts[i], self.chat)
            if len(ids) > limit:
                skipped += 1
                continue
            chosen.append((i, texts[i], ids))
        return chosen, skipped

    def _dataset(self, pair, ds: str, note) -> list:
        chosen, skipped = self._pick(pair, self.texts[ds], self.n_prompts)
        if not chosen:
            raise UserError(f"no prompt of dataset {ds!r} fits in {self.max_prompt_tokens} tokens (and the context "
                            "with max_new_tokens); raise max_prompt_tokens or lower max_new_tokens")
        if skipped:
            note(f"{ds}: {skipped} prompt(s) longer than the token limit were skipped")
        if len(chosen) < self.n_prompts:
            note(f"{ds}: only {len(chosen)} prompts (n_prompts = {self.n_prompts})")
        return chosen


@dataclass(frozen=True)
class Measures:
    """What a sweep measures once (from its grid): the forward times (`costs`), the tree rates of each
    verification in `methods` (on batch drafting of `width` siblings, with the sweep's sampling and length), a
    learned budget's node cost."""

    costs: bool
    methods: tuple[str, ...]
    node_cost: bool
    width: int
    sampling: SamplingParams
    max_new_tokens: int
    progress: bool


@dataclass(frozen=True)
class Calibrated:
    """What every tree run starts from: verification -> its rates, the hash of their calibration's settings (tree
    rows' tree_calibration), the measured node cost (None: none measured)."""

    rates: dict
    calibration: str | None = None
    node_cost: float | None = None


def calibrate(pairs: dict, need: Measures, prompts: list, folder: SweepFolder, note) -> Calibrated:
    """The sweep's tree rates, measured on `prompts`, (i, text, ids), with the first pair (or read back from the
    out_dir), and its pinned forward times (every pair's, _pin_costs); what was measured goes to `note`."""
    rates, calibration = {}, None
    if need.methods:
        if not prompts:
            raise UserError("no prompt is left to calibrate the tree policies on: every prompt that fits is "
                            "evaluated; lower n_prompts or add a dataset with more prompts")
        pair = next(iter(pairs.values()))
        settings = {"sweep": folder.hash, "width": need.width, "prompts": [prompt_sha(t) for _, t, _ in prompts],
                    "vocab_size": pair.target.vocab_size}
        ids = [ids for _, _, ids in prompts]
        cal = load_or_calibrate(folder.path / TREE_CALIBRATION, settings, need.methods, lambda m: measure_rates(
            pair, ids, need.sampling, need.max_new_tokens, m, need.width, progress=need.progress),
            folder.path / RESULTS)
        rates, calibration = {m: cal[m]["cond_rates"] for m in need.methods}, settings_hash(settings)
        note(*(f"tree acceptance rates c_i ({m}, {len(prompts)} calibration prompts): "
               f"{[round(c, 3) for c in rates[m][:6]]}" for m in need.methods))
    costs = _pin_costs(pairs, folder.path, note) if need.costs else None
    if need.node_cost:
        note(f"tree node_cost auto = (t_draft + t_cand) / t_target = {costs.node_cost:.4g} "
             f"(t_draft/t_target = {costs.c:.4g}; {costs.measured})")
    return Calibrated(rates, calibration, costs.node_cost if need.node_cost else None)


def _pin_costs(pairs: dict, out: Path, note):
    """The one measurement of t_draft, t_target and t_cand that every auto pick of the sweep reads, pinned in
    out/costs.json: a resumed sweep reuses it, so its auto rows mean the same before and after an interruption;
    a `drafts` entry other than the first pins its own (costs@ENTRY.json). Returns the first pair's."""
    pinned = []
    for draft, pair in pairs.items():
        name = COSTS if not pinned else f"costs@{draft.replace(':', '-')}.json"
        costs = measure_costs(pair, pin=out / name)
        table = getattr(costs, "t_verify", ())
        v = f", v(1..{len(table)}) = {' '.join(f'{t / table[0]:.2f}' for t in table)} target steps" if table else ""
        note(f"auto picks{f' with draft {draft}' if draft else ''} read the forward times pinned in "
             f"{name}: t_draft/t_target = {costs.c:.4g}{v} (measured {costs.measured})")
        pinned.append(costs)
    return pinned[0]


def load_or_calibrate(path: Path, settings: dict, methods, measure, results: Path | None = None) -> dict:
    """The calibration file at `path`, {"settings", <method>: rates, ...}, with every method of `methods` in it:
    a file of the same settings is reused, a method it lacks is measured with `measure(method)` and saved at once
    (a killed calibration keeps the methods it finished); a file of other settings is replaced, unless rows of
    `results` (a sweep's results.jsonl) ran with its rates: measuring new ones would mix two calibrations in one
    comparison."""
    path = Path(path)
    cal = read_json(path, required=False, hint="delete it to recalibrate") or {}
    if cal.get("settings") != settings:
        used = results is not None and bool(cal) and settings_hash(cal.get("settings", {})) in {
            r.get("tree_calibration") for r in read_jsonl(results)}
        if used:
            problem = settings_problem(path, cal.get("settings", {}), settings, "tree calibration")
            raise UserError(f"{problem}, and the tree rows in {RESULTS} used it; restore datasets, "
                            "tree_calibration_prompts and tree_calibration_width, or use another out_dir")
        cal = {"settings": settings}
    for method in methods:
        if method not in cal:
            cal[method] = measure(method)
            write_json(path, cal, indent=1)
    return cal


def measure_rates(pair, prompts: list[list[int]], sampling, max_new_tokens: int, method: str = "gsd",
                  width: int = 8, seed: int = CALIBRATION_SEED, progress: bool = False) -> dict:
    """{"cond_rates", "trials", "hits"} of verification `method` (gsd | ersd) over the token-id
    prompts: every run adapts one shared estimate (weight 1 prior, i.e. the data dominates)."""
    est = PositionalRates(weight=1.0, adapt=True, method=method)
    runs = [(i, d, k or width) for i in range(len(prompts)) for d, k in CALIBRATION_RUNS]
    bar = tqdm(runs, desc=f"calibrate {method}", unit="run", dynamic_ncols=True, disable=not progress,
               file=sys.stderr)
    for i, drafting, k in bar:
        # carry_rates: the shared estimate must keep what each run adds, not restore it per generation
        pol = TreePolicy(method, drafting, k, rates=est, carry_rates=True)
        pair.decoder.generate(prompts[i], max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                              seed=seed + i)
        bar.set_postfix_str(f"c0={est.cond()[0]:.3f}")
    return est.to_dict()


def verification(conf: Configuration) -> str | None:
    """The verification whose calibrated rates a `trees` configuration starts from (None: it reads none)."""
    return VERIFICATION.get(conf.policy.name) if conf.source is Source.TREES else None


def auto_node_cost(conf: Configuration) -> bool:
    """A `trees` configuration with a learned budget whose node cost the sweep measures (unset)."""
    return verification(conf) is not None and conf.policy.tree_learned and conf.policy.tree_node_cost is None


def reads_costs(conf: Configuration) -> bool:
    """Whether it reads the sweep's pinned forward times: an auto shorthand, a measured node cost, any
    `policies` entry (its policy may pick per machine)."""
    shorthand_auto = conf.source is Source.SHORTHAND and conf.reads_auto
    return conf.source is Source.POLICIES or auto_node_cost(conf) or shorthand_auto
