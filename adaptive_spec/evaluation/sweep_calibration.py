"""What the runs of a sweep share that is measured once, after the pairs load, and pinned in its out_dir so that a
resumed sweep reads the same: the forward times every auto pick reads (costs.json: ks / thresholds auto, a learned
tree budget's node cost) and the tree policies' acceptance rates (tree_calibration.json, measured by
tree_calibration.measure_rates on prompts no configuration is evaluated on). Measures says what a sweep needs
(its plan's); `calibrate` measures it, or reads it back. Part of `adaptive-spec sweep`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..decoding.auto import measure_costs
from ..decoding.pipeline import torch_threads
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..runs import read_json, read_jsonl, settings_problem, write_json
from .sweep_files import COSTS, RESULTS, TREE_CALIBRATION, SweepFolder, prompt_sha, settings_hash
from .sweep_grid import Configuration, Source
from .tree_calibration import VERIFICATION, measure_rates


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
    """The sweep's pinned forward times (every pair's, _pin_costs) and its tree rates, measured on `prompts`, (i,
    text, ids), with the first pair (or read back from the out_dir); what was measured goes to `note`."""
    costs = _pin_costs(pairs, folder.path, note) if need.costs else None
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
        # on the threads the decode has (the engine's decode_torch_threads), as generate's auto measures:
        # one measurement, one cache key, per machine
        with torch_threads(pair.engine.decode_torch_threads):
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
