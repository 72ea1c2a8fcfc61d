"""Typed parameters: the pair's settings and each stop policy's, validated once, on construction, by every way
in (the `generate` flags, `SpecPair`'s keywords, the sweep). Nothing here imports torch, so every refusal comes
before the weights. How a class is built, refused and registered: typed.py.

    policy_params("learned", head="checkpoints/qwen-coder-0.5b-d3-wrej6", threshold=0.3)"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PlainSerializer, ValidationError, model_validator

from .backends import engines, presets
from .backends.paths import FeatureDraft, check_draft_vocab_spec, parse_draft, parse_draft_vocab, resolve_model_path
from .errors import UserError
from .heads.curve import load_curve
from .heads.folder import check_head_folder, head_needs
from .registry import Needs
from .typed import (AUTO, NonNegativeInt, Params, PolicyParams, PositiveInt, UnitOpen, build, expecting, explain,
                    policy, policy_class, policy_classes)


def policy_params(name: str, spell=lambda key: key, **values) -> PolicyParams:
    """Policy `name`'s settings from keywords; unset ones take the policy's defaults."""
    return build(policy_class(name), values, f"policy {name}", spell)


def check_runs_on(policy: PolicyParams, engine: "engines.Engine | str") -> None:
    """Refuse `policy` on an engine that lacks what it needs, naming the policies that run there and the engines
    it runs on."""
    engine = engines.get(engine) if isinstance(engine, str) else engine
    need = set(policy.needs.engine)
    missing = sorted(need - set(engine.capabilities))
    if not missing:
        return
    fits = [n for n, cls in policy_classes().items() if set(cls.static_needs) <= set(engine.capabilities)]
    why = "; ".join(engines.CAPABILITIES.get(m, m) for m in missing)
    others = [n for n in engines.names() if need <= set(engines.get(n).capabilities)]
    raise UserError(f"policy {policy.name!r} does not run on the {engine.name} backend: it needs {why}, which "
                    f"{engine.name} does not give; policies that do run there: {', '.join(fits)}"
                    + (" (learned with a statistics head, inputs=stats)" if "learned" in fits else "")
                    + (f"; or use --backend {' or '.join(others)}" if others else ""))


K_MAX = Field(20, ge=1, description="hard cap on candidates per round", **expecting("an integer >= 1"))
CURVE = Field(None, description="threshold_curve.json (or its folder) for auto; default: the one beside the head "
                                "(made by `adaptive-spec autotune`)")


def _check_auto(value, curve, head, need: str) -> None:
    """auto reads a curve: it must exist now, before any model loads; a curve without auto is a mistake."""
    if value == AUTO:
        load_curve(curve or (head if isinstance(head, (str, Path)) else None), need,
                   head if isinstance(head, (str, Path)) else None)
    elif curve is not None:
        flag = "--threshold" if need == "h" else "--k"
        raise ValueError(f"--curve is read only by {flag} auto; drop it or pass {flag} auto")


@policy("ar")
class ARParams(PolicyParams):
    """The target alone: no draft, no settings."""

    @property
    def needs(self) -> Needs:
        return Needs(draft_model=False)


@policy("fixed")
class FixedParams(PolicyParams):
    """Classic speculative decoding: K candidates every round."""

    k: PositiveInt | Literal["auto"] = Field(4, description="candidates per round (auto: the K of best predicted "
                                     "throughput on this machine, from a curve)",
                                     **expecting("an integer >= 1 or auto"))
    curve: str | None = CURVE

    @model_validator(mode="after")
    def _auto(self):
        _check_auto(self.k, self.curve, None, "k")
        return self


@policy("learned")
class LearnedParams(PolicyParams):
    """SpecDec++: stop when 1 - prod p_hat_i > h, or at k_max."""

    head: Any = Field(None, description="acceptance head folder (or hub id)")
    threshold: UnitOpen | Literal["auto"] | None = Field(
        None, description="h in (0, 1) (auto: the h of best predicted throughput on this machine, from "
        "the head's threshold_curve.json)", **expecting("h in (0, 1) or auto"))
    k_max: int = K_MAX
    curve: str | None = CURVE

    @property
    def needs(self) -> Needs:
        return Needs(engine=head_needs(self.head))

    @model_validator(mode="after")
    def _complete(self):
        if self.threshold is None:
            raise ValueError("the learned policy needs --threshold h in (0, 1) (the paper's best is about 0.7), or "
                             "--threshold auto")
        check_head_folder(self.head, "the learned policy")
        _check_auto(self.threshold, self.curve, self.head, "h")
        return self


@policy("confidence")
class ConfidenceParams(PolicyParams):
    """Stop after a candidate with q(y_i) < tau (transformers' assisted-generation rule)."""

    threshold: float = Field(0.4, gt=0, lt=1, description="tau in (0, 1)", **expecting("tau in (0, 1)"))
    k_max: int = K_MAX


@policy("entropy")
class EntropyParams(PolicyParams):
    """Stop after a candidate drawn from a distribution with entropy > tau nats (AdaEDL, SVIP)."""

    threshold: float = Field(1.0, gt=0, description="tau > 0 nats", **expecting("tau > 0 nats"))
    k_max: int = K_MAX


@policy("heuristic")
class HeuristicParams(PolicyParams):
    """transformers' schedule: K += 2 after a fully accepted round, K -= 1 otherwise."""

    k: int = Field(5, ge=1, description="the starting K", **expecting("an integer >= 1"))
    k_max: int = K_MAX


@policy("oracle")
class OracleParams(PolicyParams):
    """The hindsight oracle of Theorem 4.1 (greedy only)."""

    k_max: int = Field(10_000, ge=1, **expecting("an integer >= 1"))
    target_output: list[int] | None = Field(None, description="the target's greedy output, where known",
                                            json_schema_extra={"cli": False})

    def check_sampling(self, temperature: float) -> None:
        if temperature > 0:
            raise UserError("the hindsight oracle is defined for greedy decoding; use --temperature 0")


@policy("ngram")
class NgramParams(PolicyParams):
    """Prompt lookup: candidates copied from the prompt and the text so far (no draft model needed),
    as many as pay for their rows (k auto) or k after every match; with fallback learned, the draft
    model drafts under SpecDec++ in the rounds nothing is copied."""

    k: PositiveInt | Literal["auto"] = Field(
        "auto", description="ngram: copied tokens per round (auto: as many as pay for their verification "
        "rows on this machine)", **expecting("an integer >= 1 or auto"))
    ngram_max: int = Field(4, ge=1, description="ngram: longest context suffix looked up", **expecting("an integer >= 1"))
    ngram_min: int = Field(2, ge=1, description="ngram: shortest context suffix looked up",
                           **expecting("an integer >= 1"))
    k_max: int = Field(48, ge=1, description="hard cap on candidates per round", **expecting("an integer >= 1"))
    fallback: Literal["none", "learned"] = Field(
        "none", description="ngram: rounds without a copy: none (a plain target step) or learned (the draft "
        "model under SpecDec++, --head and --threshold)", **expecting("none or learned"))
    head: Any = Field(None, description="acceptance head folder (or hub id)")
    threshold: UnitOpen | Literal["auto"] | None = Field(None, **expecting("h in (0, 1) or auto"))
    curve: str | None = CURVE

    @model_validator(mode="after")
    def _consistent(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"--ngram-min ({self.ngram_min}) must not exceed --ngram-max ({self.ngram_max})")
        if self.fallback == "learned":
            self.fallback_params()
        elif self.head is not None or self.threshold is not None or self.curve is not None:
            raise ValueError("--head, --threshold and --curve are read by the ngram policy only with --fallback learned")
        return self

    @property
    def needs(self) -> Needs:
        learned = self.fallback == "learned"
        # copying rounds never need the draft: it catches up on the prompt in its first model round
        return Needs(draft_model=learned, prefilled_draft=False, engine=head_needs(self.head) if learned else frozenset())

    def fallback_params(self) -> "LearnedParams":
        """The draft model's stop rule in the rounds nothing is copied (checked on construction)."""
        try:
            return LearnedParams(head=self.head, threshold=self.threshold, curve=self.curve)
        except ValidationError as e:
            raise ValueError("--fallback learned: " + explain(e, LearnedParams, "--fallback learned")) from None


DRAFTING = Literal["tree", "sequence", "batch", "specinfer"]
ESTIMATOR = Literal["positional", "head"]


class _TreeBase(PolicyParams):
    static_needs: ClassVar[frozenset] = frozenset({"tree"})
    tree_budget: int | None = Field(None, ge=1, description="drafted tokens per round (default: k, else 8)",
                                    **expecting("an integer >= 1"))
    tree_estimator: ESTIMATOR = Field("positional", description="acceptance estimates: positional rates or a "
                                      "trained head (--head)", **expecting("positional or head"))
    head: Any = Field(None, description="acceptance head folder for --tree-estimator head")
    k: int | None = Field(None, ge=1, description="tokens per round where no budget is given",
                          **expecting("an integer >= 1"))
    tree_rates: Any = Field(None, description="calibration.json of per-sibling acceptance rates for tree policies "
                            "(bench_trees writes one)")
    adapt_rates: bool = Field(True, description="the rates follow the generation's own rounds (false: frozen at "
                              "tree_rates)", json_schema_extra={"cli": False, "expects": "true or false"})
    tree_learned: bool = Field(False, description="draft as many tokens per round as are worth their cost (at "
                               "most tree_budget)", **expecting("true or false"))
    tree_node_cost: float | None = Field(None, gt=0, allow_inf_nan=False, description="with tree_learned: the cost "
                                         "of one drafted token in target steps (default: measured)",
                                         **expecting("> 0 and finite (target steps per drafted token)"))
    drafting: DRAFTING = Field("tree", description="draft shape (tree = the optimal one)",
                               **expecting("tree, sequence, batch or specinfer"))

    @property
    def needs(self) -> Needs:
        return Needs(engine=self.static_needs | (frozenset({"hidden"}) if self.tree_estimator == "head" else frozenset()))

    @model_validator(mode="after")
    def _consistent(self):
        if self.tree_estimator == "head":
            check_head_folder(self.head, "--tree-estimator head")
        elif self.head is not None:
            raise ValueError("--head is read by the tree policies only with --tree-estimator head")
        if self.tree_node_cost is not None and not self.tree_learned:
            raise ValueError("--tree-node-cost applies only with --tree-learned")
        return self


@policy("tree")
class TreeParams(_TreeBase):
    """GSD: the optimal draft tree of tree_budget tokens per round."""


@policy("ersd")
class ErsdParams(_TreeBase):
    """Exponential-race SD over a draft of the given shape."""

    num_drafts: int | None = Field(None, ge=1, description="alternatives for the next token (drafting batch)",
                                   **expecting("an integer >= 1"))

    @model_validator(mode="after")
    def _drafts(self):
        if self.num_drafts is not None and self.drafting != "batch":
            raise ValueError("--num-drafts applies to ersd only with --drafting batch")
        return self


class _MultiDraft(PolicyParams):
    static_needs: ClassVar[frozenset] = frozenset({"multi_draft"})
    num_drafts: int = Field(4, ge=1, description="drafts per round", **expecting("an integer >= 1"))
    k: int = Field(4, ge=1, description="tokens per draft", **expecting("an integer >= 1"))


@policy("spectr")
class SpecTrParams(_MultiDraft):
    """SpecTr: num_drafts i.i.d. drafts of k tokens, K-SEQ selection."""


@policy("batch-sd")
class BatchSDParams(_MultiDraft):
    """Batch speculative decoding: num_drafts i.i.d. drafts of k tokens."""


# ---- the model pair --------------------------------------------------------------------------

_GGUF = ", ".join(engines.GGUF_QUANTS)
# every engine's names; which engine takes which is checked by PairParams._engine.
# Literal[tuple] and not Literal[..., *names]: unpacking in a subscript is Python 3.11 grammar
DraftQuant = Literal[engines.quant_names("draft")]
TargetQuant = Literal[engines.quant_names("target")]


class PairParams(Params):
    """Which models, on which engine, with which numerics (SpecPair.load)."""

    target: str = Field("default", description="target model: hub id, local folder or 'default' (llama.cpp: a "
                        ".gguf, a folder of one, or owner/repo:FILE.gguf)")
    draft: str | Annotated[FeatureDraft, PlainSerializer(str)] | None = Field(  # stored as given: feature:PATH
        "default", description="draft model, as --target; none: no draft model (the target alone, or --policy "
        "ngram); feature:PATH: a feature drafter (drafter/) on the target's hidden states")
    backend: str = Field(
        "torch", description="engine: torch (Hugging Face weights; the default pair dequantized to bf16) or "
        "llama.cpp (the GGUF files as they are, through llama-cpp-python; CPU)",
        **expecting("a registered engine (backends/engines.py): torch or llama.cpp"))
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="weights' dtype (auto: bf16 on GPUs and on CPUs with bf16 kernels, fp32 on AVX2-only "
        "CPUs, where bf16 matrix products are several times slower)", **expecting("auto, bf16, fp16 or fp32"))
    draft_quant: DraftQuant = Field(
        "none", description="draft weights, exactness unchanged: torch: none, int8 (weight-only, per-channel) or "
        "int4 (weight-only, groups of 64; CPU); llama.cpp: none (the GGUF as it is) or " + _GGUF
        + " (the draft GGUF re-quantized once by llama.cpp and cached; -pure: every matrix, output included, "
        "in that type)", **expecting("none, " + ", ".join(engines.TORCH_DRAFT_QUANTS) + " (torch), or " + _GGUF + " (llama.cpp)"))
    target_quant: TargetQuant = Field(
        "none", description="llama.cpp: the target GGUF re-quantized once (cached), e.g. q4_0-pure, whose matrices "
        "all have multi-row CPU kernels (cheaper verification); the output then follows that file exactly",
        **expecting("none or " + _GGUF + " (llama.cpp)"))
    draft_vocab: str | None = Field(
        None, description="draft output layer keeps the N most frequent tokens (both engines; shipped list for the default "
        "tokenizer) or those of a list from `adaptive-spec draft-vocab` (N | FILE | FILE:N); default: all (a feature "
        "drafter: the one it was trained on)",
        **expecting("N >= 1, FILE or FILE:N"))
    # the form only: whether this machine reaches the device is the engine's check (engines.check_device), made
    # where a pair is about to load, so a stored config that names a GPU still reads on a CPU machine
    device: str | None = Field(None, pattern=engines.DEVICE_FORM, description="cpu, cuda, cuda:1 ... (default: cuda "
                               "if available)", **expecting("cpu, cuda or cuda:N (default: cuda where a GPU is visible)"))
    threads: int | None = Field(None, ge=1, description="CPU threads (default: torch's count)",
                                **expecting("an integer >= 1"))
    n_ctx: int | None = Field(None, ge=1, description="llama.cpp: context positions (default 4096)",
                              **expecting("an integer >= 1"))
    draft_context: int | None = Field(None, ge=1, description="the draft sees only the last N prompt tokens (a "
                                      "shorter prefill before the first token; costs acceptance, never exactness)",
                                      **expecting("an integer >= 1"))
    kv_cache: Literal["auto", "dynamic", "static"] = Field(
        "auto", description="torch: KV caches dynamic (grow and crop) or static (preallocated, indexed by "
        "position); auto: static on a GPU, dynamic on the CPU", **expecting("auto, dynamic or static"))
    runtime: Literal["auto", "eager", "cudagraph", "compile"] = Field(
        "auto", description="torch with the static KV cache: one captured graph per input length, by torch.compile "
        "(compile) or by capturing the eager step (cudagraph; GPU); auto: compile on a GPU (cudagraph where "
        "compile fails), eager on the CPU", **expecting("auto, eager, cudagraph or compile"))
    fused: bool | Literal["auto"] = Field(
        "auto", description="torch with the static KV cache: the fused decoder (q/k/v and gate/up one matrix each, "
        "several times fewer kernels a step: backends/fused.py); auto: on a GPU where the architecture is "
        "supported", **expecting("auto, true or false"))
    max_cache_len: int | None = Field(None, ge=1, description="static KV cache: preallocated positions",
                                      **expecting("an integer >= 1"))
    host_reads: PositiveInt | Literal["auto", "round", "token"] = Field(
        "auto", description="when the decode loop reads the device: once a round (round: the stop rule and the "
        "sampling run on the device, in the draft step's graph, and a round drafts up to a cap learned from the "
        "rule's recent stops), every N drafted tokens (N: the same on the device, reading whether the rule "
        "stopped), or after every drafted token (token: the rule decides on the host); auto: round on a GPU, "
        "token on the CPU", **expecting("auto, round, token or an integer N >= 1"))
    # torch's CPU kernels (backends/cpu/packed.py): chosen by timing once per CPU and model shape, then cached;
    # these fix the choice (a benchmark of one path, or a CPU where the timing misleads)
    cpu_stock: bool = Field(False, description="torch on CPU: stock torch kernels (default: the linear layers "
                            "pre-packed for oneDNN where it has a kernel for the dtype)", **expecting("true or false"))
    cpu_pad_rows: NonNegativeInt | Literal["auto"] = Field(
        "auto", description="torch on CPU: pad every input of fewer than N rows to N (0: never; auto: the row "
        "counts timed fastest on this CPU)", **expecting("auto or a row count >= 0"))
    cpu_fp16_rows: NonNegativeInt | Literal["auto"] = Field(
        "auto", description="torch on CPU, fp32 models: run inputs of at most N rows on an fp16 weight copy (0: "
        "never; auto: the row counts timed faster on this CPU)", **expecting("auto or a row count >= 0"))
    pair: str | None = Field(None, description="a named pair by hub ids (backends/presets.py), e.g. coder-0.5b-7b "
                             "for a GPU: sets --draft and --target; default: the default pair", **expecting(
                                 "one of " + ", ".join(presets.PRESETS)))

    @model_validator(mode="before")
    @classmethod
    def _vocab_as_text(cls, values):
        if isinstance(values, dict) and values.get("pair") is not None:
            if values["pair"] not in presets.PRESETS:
                raise ValueError(f"unknown pair preset {values['pair']!r}; presets: {', '.join(presets.PRESETS)}")
            named = [k for k in ("draft", "target") if values.get(k) not in (None, "default")]
            if named:
                raise ValueError(f"--pair {values['pair']} names both models; drop --{' and --'.join(named)} "
                                 "or --pair")
            p = presets.PRESETS[values["pair"]]
            # "default" stays the fetched default pair (its hub ids are the same models, converted once)
            models = ("default", "default") if p.name == "default" else p.hub_ids
            values = {**values, "draft": models[0], "target": models[1]}
        if isinstance(values, dict) and isinstance(values.get("draft_vocab"), int):
            values = {**values, "draft_vocab": str(values["draft_vocab"])}
        if isinstance(values, dict) and isinstance(values.get("draft"), str):
            values = {**values, "draft": parse_draft(values["draft"])}  # none: the target alone; feature:PATH
        return values

    @model_validator(mode="after")
    def _engine(self):
        engine = engines.get(self.backend)  # unknown: refused naming the registered ones
        if self.pair not in (None, "default") and engine.model_files != "hf":
            raise ValueError(f"--pair {self.pair} names Hugging Face models; the {self.backend} backend loads "
                             f"{engine.model_files} files: pass --target and --draft")
        for key, valid in (("draft_quant", engine.draft_quants), ("target_quant", engine.target_quants)):
            if getattr(self, key) not in valid:
                raise ValueError(f"{key}={getattr(self, key)!r} does not run on the {self.backend} backend; it takes "
                                 f"{', '.join(valid)}")
        # a setting another engine reads, set away from its default: this engine would silently ignore it
        unused = [k for k in sorted(engines.engine_settings() - engine.settings)
                  if getattr(self, k) != type(self).model_fields[k].default]
        readers = [n for n in engines.names() if all(k in engines.get(n).settings for k in unused)]
        if engine.devices is not None and self.device not in (None, *engine.devices):
            unused.append("device")
            readers = [n for n in readers if engines.get(n).devices is None]
        if unused:
            given = ", ".join(f"{k}={getattr(self, k)!r} (--{k.replace('_', '-')})" for k in unused)
            many = len(unused) > 1
            raise ValueError(f"{given}: the {self.backend} backend ({engine.description}) reads no such "
                             f"setting{'s' if many else ''}; drop {'them' if many else 'it'}"
                             + (f" or use --backend {' or '.join(readers)}" if readers else ""))
        if self.runtime in ("cudagraph", "compile") and self.kv_cache == "dynamic":
            raise ValueError(f"--runtime {self.runtime} needs the static KV cache: add --kv-cache static (or leave "
                             "--kv-cache auto)")
        if self.fused is True and self.kv_cache == "dynamic":
            raise ValueError("--fused true needs the static KV cache: add --kv-cache static (or leave --kv-cache auto)")
        if self.runtime == "cudagraph" and self.device == "cpu":
            raise ValueError("--runtime cudagraph captures CUDA graphs: use a GPU (--device cuda) or --runtime eager")
        if isinstance(self.draft, FeatureDraft) and ("hidden" not in engine.capabilities or self.draft_quant != "none"):
            raise ValueError("a feature drafter is one layer over the target's hidden states: it runs on --backend "
                             "torch (which returns them), unquantized (no --draft-quant)")
        if self.draft_context is not None and self.draft is None:
            raise ValueError("draft_context (--draft-context) sets the draft's window; there is no draft (--draft none)")
        if self.draft_vocab is not None:
            check_draft_vocab_spec(self.draft_vocab)
        return self

    def cpu_kernels(self) -> dict:
        """load_model's keywords for the torch CPU kernel choice (None: timed and cached)."""
        return {"pack": not self.cpu_stock, "pad_rows": None if self.cpu_pad_rows == "auto" else self.cpu_pad_rows,
                "fp16_rows": None if self.cpu_fp16_rows == "auto" else self.cpu_fp16_rows}

    @property
    def engine(self) -> engines.Engine:
        return engines.get(self.backend)

    def check_draft_vocab_size(self) -> None:
        """N of draft_vocab N against the draft's vocabulary, read from its config.json (no weights):
        the upper bound, refused before anything loads."""
        parsed = parse_draft_vocab(self.draft_vocab) if isinstance(self.draft, str) else None
        if parsed is None or parsed[1] is None:
            return
        try:  # a check never downloads: an unfetched default draft is checked when it loads
            config = Path(resolve_model_path(self.draft, "draft", auto_fetch=False)) / "config.json"
        except UserError:
            return
        if config.is_file():
            size = json.loads(config.read_text()).get("vocab_size")
            if size is not None and parsed[1] > size:
                raise UserError(f"--draft-vocab must be in 1..{size} (the draft's vocabulary size), got {parsed[1]}")


def pair_params(spell=lambda key: key, **values) -> PairParams:
    return build(PairParams, values, "the model pair", spell)
