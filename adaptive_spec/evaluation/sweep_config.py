"""A sweep's config: SweepConfig, every key checked before anything loads (each list as its policy's setting,
the `policies` and `trees` entries as their grid configurations). Part of `adaptive-spec sweep` (sweep.py:
the module doc has the keys; sweep_grid.py: the configurations it expands to)."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from ..backends import engines
from ..backends.paths import FeatureDraft
from ..config import Config
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..params import PairParams, check_runs_on
from ..typed import fits, policy_class
from .sweep_grid import AUTO, Source, build_grid


class SweepConfig(Config):
    name: str = ""  # names the default out_dir runs/sweep/<name>; defaults to the config file's stem
    # the models, as `generate` takes them (params.PairParams): pair: {draft_quant: int8, backend: llama.cpp, ...}
    pair: PairParams = Field(default_factory=PairParams)
    # draft configurations run side by side against one target, each QUANT[:VOCAB] as generate's --draft-quant
    # and --draft-vocab take them (e.g. [none, int8, int8:32768]); every configuration that drafts runs once per
    # entry (its key ends in @ENTRY), the target alone once. Empty: the pair's own draft only
    drafts: list[str] = Field(default_factory=list)
    # prompts
    datasets: list[str] = Field(default_factory=lambda: ["alpaca"])
    fields: dict = Field(default_factory=dict)  # dataset -> text field (default: the set's own)
    hf_configs: dict = Field(default_factory=dict)  # hub dataset -> configuration name
    hf_splits: dict = Field(default_factory=dict)  # hub dataset -> split
    n_prompts: int = 30
    max_prompt_tokens: int = 1024  # longer prompts are skipped (the next shuffled prompt takes the place)
    chat: bool = True  # wrap prompts in the tokenizer's chat template
    # sampling (paper appendix D.1: T = 1, top-k 50)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 0  # prompt shuffle and generation seeds
    # the grid
    # and/or auto; a float is let through typing for validate() to refuse with its reason
    ks: list[int | float | str] = Field(default_factory=lambda: list(range(1, 15)))
    heads: list[str] = Field(default_factory=list)  # head folders (or training output dirs with head/); globs ok
    thresholds: list[float | str] = Field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    curve: str = ""  # threshold_curve.json for `ks: [auto]` (default: the one beside the first head)
    # auto's curve from the acceptance on these prompts instead (a .jsonl with a `prompt` field, a prompt set, or
    # SET:START:STOP): the loaded pair answers a few of them first, as `generate --auto-prompts` does; every auto in
    # ks, thresholds and policies then picks from that curve (one per head, made once and cached)
    auto_prompts: str = ""
    k_max: int = 20  # hard cap on candidates per round for the adaptive policies (paper: 20)
    confidence_taus: list[float] = Field(default_factory=list)
    entropy_taus: list[float] = Field(default_factory=list)
    heuristic: bool = False
    oracle: bool = False  # greedy only; skipped with a note when temperature > 0
    include_ar: bool = True
    include_draft_ar: bool = True
    hf_assisted: bool = False
    hf_prompt_lookup: bool = False
    # tree / multi-draft configurations (module doc of sweep.py): each entry is the settings of its policy's
    # params class, as `policies` entries are, with rates calibrated by the sweep; checked by build_grid
    trees: list[Any] = Field(default_factory=list)
    # any policy by the settings `generate` takes (params.py), one configuration each, checked by the
    # policy's own params class: [{policy: ngram}, {policy: ngram, k: 3}, {policy: ngram, fallback: learned,
    # head: DIR, threshold: auto}]; `label` names the configuration in the report (default: its settings)
    policies: list[Any] = Field(default_factory=list)
    tree_calibration_prompts: int = 2  # per dataset: prompts the tree acceptance rates are measured on
    tree_calibration_width: int = 8  # siblings of the calibration's batch drafting
    # running
    warmup: bool = True  # one short untimed generation per kind before the first timed run
    out_dir: str = ""  # default runs/sweep/<name>, relative to the project root
    overwrite: bool = False  # discard results of other settings found in out_dir (same settings: resumed)
    progress: bool = True
    # rows keep each generation's verified rounds as `trace`, [[K, n accepted, source], ...], and config.json
    # the models that made them (trace_pair): decoding/replay.py replays them on other weights of the same shapes
    record_trace: bool = False

    def validate(self) -> None:
        if not self.datasets or not all(isinstance(d, str) and d.strip() for d in self.datasets):
            raise UserError("config key 'datasets' must be a non-empty list of dataset names or paths")
        if len(set(self.datasets)) != len(self.datasets):
            raise UserError(f"config key 'datasets' lists a dataset twice: {self.datasets}")
        for key in ("fields", "hf_configs", "hf_splits"):
            d = getattr(self, key)
            if not isinstance(d, dict):
                raise UserError(f"config key '{key}' must be a mapping dataset: value, got {d!r}")
            stray = sorted(set(d) - set(self.datasets))
            if stray:
                raise UserError(f"config key '{key}' names dataset(s) {', '.join(map(repr, stray))} that are not in "
                                f"datasets ({', '.join(self.datasets)})")
        for key in ("n_prompts", "max_new_tokens", "max_prompt_tokens", "k_max", "tree_calibration_prompts",
                    "tree_calibration_width"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        SamplingParams(self.temperature, self.top_k, self.top_p)
        self.ks = [_auto_or(k, int, "ks") for k in self.ks]
        self.thresholds = [_auto_or(h, float, "thresholds") for h in self.thresholds]
        # each value is one setting of a policy: its params field checks it, as generate's flag would
        for key, name, setting in (("ks", "fixed", "k"), ("thresholds", "learned", "threshold"),
                                   ("confidence_taus", "confidence", "threshold"),
                                   ("entropy_taus", "entropy", "threshold")):
            _check_setting(getattr(self, key), key, name, setting)
        if self.heads and not self.thresholds:
            raise UserError("heads are given but thresholds is empty; list the h values to sweep")
        grid, _, _ = build_grid(self)
        if self.pair.draft is None and any(c.policy.needs.draft_model for c in grid):
            raise UserError("pair.draft is none, but the grid drafts with a draft model (ks, heads, taus, heuristic, "
                            "oracle, trees, include_draft_ar or a policy that uses one): name a draft model (default: "
                            "the default pair's), or keep only ar and policies without one (ngram)")
        engine = self.pair.engine
        for key, need in (("hf_assisted", "hf_generate"), ("hf_prompt_lookup", "hf_generate"), ("trees", "tree")):
            if getattr(self, key) and need not in engine.capabilities:
                raise UserError(f"{key} needs {engines.CAPABILITIES[need]}, which the {engine.name} backend does not "
                                f"give; set it off for pair.backend {engine.name}, or use backend torch")
        self._check_auto_prompts(grid)
        if AUTO in self.ks and not (self.curve or self.heads or self.auto_prompts):
            raise UserError("ks lists auto but neither curve nor heads is given: set curve to a threshold_curve.json "
                            "(made by `adaptive-spec autotune`), or list a head that has one")
        self._check_drafts()
        for conf in grid:
            if conf.source is not Source.SHORTHAND:  # a shorthand's policy is complete only once the sweep runs
                try:
                    check_runs_on(conf.policy, engine)
                except UserError as e:
                    raise UserError(f"{conf.source.value}: {e}") from None

    def _check_auto_prompts(self, grid: list) -> None:
        """auto_prompts is read by some auto and names prompts that load (before any model does)."""
        if not self.auto_prompts:
            return
        if not (AUTO in self.ks or AUTO in self.thresholds or any(c.reads_auto for c in grid)):
            raise UserError("config key 'auto_prompts' is read by auto in ks, thresholds or a policies entry only; "
                            "list auto there, or drop auto_prompts")
        from ..decoding.auto import load_texts  # noqa: PLC0415 (the prompt sets: only where asked)

        try:
            load_texts(self.auto_prompts)
        except UserError as e:
            raise UserError(f"config key 'auto_prompts': {e}") from None

    def _check_drafts(self) -> None:
        """`drafts`: distinct draft configurations of the pair's draft model, without trees (the plan makes each
        entry's pair: sweep.draft_pairs)."""
        if not self.drafts:
            return
        if not isinstance(self.drafts, list) or not all(isinstance(d, str) and d for d in self.drafts):
            raise UserError(f"config key 'drafts' must be a list of draft configurations QUANT[:VOCAB] such as "
                            f"[none, int8, int8:32768], got {self.drafts!r}")
        if len(set(self.drafts)) != len(self.drafts):
            raise UserError(f"config key 'drafts' lists a draft configuration twice: {self.drafts}")
        if self.pair.draft is None:
            raise UserError("drafts is set but pair.draft is none: name the draft model the configurations quantize")
        if isinstance(self.pair.draft, FeatureDraft):  # its runner reads the target it was loaded with
            raise UserError("drafts compares configurations of one draft model against a shared target; a feature "
                            "drafter reads its own target's states: leave drafts empty (pair.draft_vocab sets its "
                            "vocabulary)")
        if self.trees:
            raise UserError("trees are calibrated on one draft and do not run with a drafts axis: run one sweep per "
                            "draft configuration (pair.draft_quant / pair.draft_vocab), or leave drafts empty")


def _auto_or(value, kind, key: str):
    """`auto`, or the value as `kind` (a YAML or key=value list may hold numbers as strings)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        if kind is int and (isinstance(value, bool) or float(value) != int(float(value))):
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise UserError(f"config key '{key}' takes {'integers' if kind is int else 'numbers'} or auto, "
                        f"got {value!r}") from None


def _check_setting(values: list, key: str, name: str, setting: str) -> None:
    """Every value of the list `key` as policy `name`'s `setting` (its params field, alone: the other
    settings, e.g. the learned policy's head, are checked where the configuration is built)."""
    cls = policy_class(name)
    for v in values:
        if not fits(cls, setting, v):
            expects = (cls.model_fields[setting].json_schema_extra or {}).get("expects", "valid")
            raise UserError(f"config key '{key}' lists {v!r}, but the {name} policy's {setting} must be "
                            f"{expects}")
