"""The acceptance prediction head of SpecDec++ (paper section 4.3, 5.1).

A (D+1)-layer ResNet with SiLU: D residual blocks x + SiLU(W_d x + b_d), then a linear layer to one
logit; sigmoid(logit) predicts P(Y_i accepted | Y_1..Y_{i-1} accepted). D = 0 is a single linear layer.

Which hidden state the head reads (`feature`):
  token    e_i, the state at y_i's own position (the paper's). It exists only once y_i has been fed
           to the draft, so in decoding the score of y_i arrives one step late.
  context  e_{i-1}, the state that produced q_i: it scores y_i before y_i is fed, so a round may stop
           after its first candidate (K = 1), often the best K where a draft step is not cheap.

What else it reads (`inputs`):
  hidden        that state alone (the paper's head)
  hidden+stats  that state and features.draft_stats of the candidate, standardized inside the head by
                the training set's mean and std (saved buffers); a row is [hidden (H), stats (3)]
                (`join_inputs`; `shard_inputs` per datagen position).
  stats         the statistics alone: a calibrated map (D = 0: logistic regression), the reference
                every hidden-state head must beat and one that carries over to unlike prompts. A
                context head, since the stats of y_i exist as soon as q_i does.

A saved head is a folder (or a hub repo) with config.json, model.safetensors and a model card
(hub.HubModel, a PyTorchModelHubMixin: `from_pretrained`, `push_to_hub`). The draft is part of the contract: the head
reads that draft's hidden states, so loading refuses a hidden-size mismatch."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.models import resolve_dtype
from ..errors import UserError
from ..hub import CONFIG_NAME, HubModel
from .features import CONTEXT_KEY, N_STATS, STATS, position_map, sampling_from, state_key

HEAD_FORMAT = "adaptive_spec.head.v1"
MAX_DEPTH = 4
FEATURES = ("token", "context")
INPUTS = ("hidden", "hidden+stats", "stats")


def reads_stats(inputs: str) -> bool:
    """Whether a head with these inputs reads the draft statistics (its rows end in them)."""
    return inputs in ("hidden+stats", "stats")


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


# The model card: the hub's metadata block, then model_card() below.
_CARD_TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}\n"


class AcceptanceHead(nn.Module, HubModel, library_name="adaptive-spec", model_card_template=_CARD_TEMPLATE,
                     tags=["speculative-decoding", "specdec++"], paper_url="https://arxiv.org/abs/2405.19715"):
    _NAME = "acceptance head"
    _SAVED = "head"
    _NO_WEIGHTS = "acceptance head folder {} has no {}; it is not a saved head (or its export was interrupted); "
    _REEXPORT = "re-export the head, "
    _FIX = "train one with `python train.py --config configs/train/default.yaml` or pass its folder or hub id"
    _ANCHOR = "out"

    def __init__(self, hidden_size: int, depth: int = 3, draft_model: str | None = None,
                 draft_fingerprint: str | None = None, feature: str = "token", inputs: str = "hidden",
                 stats_sampling: dict | None = None):
        super().__init__()
        if feature not in FEATURES:
            raise UserError(f"head feature must be one of {', '.join(FEATURES)}, got {feature!r}")
        if inputs not in INPUTS:
            raise UserError(f"head inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")
        if inputs == "stats" and feature != "context":
            raise UserError("a head with inputs=stats reads no hidden state, so it scores each candidate as soon as "
                            "the draft step that proposed it: set feature=context (feature=token would only add a "
                            "one-step lag)")
        if not (isinstance(depth, int) and 0 <= depth <= MAX_DEPTH):
            raise UserError(f"head depth must be an integer in 0..{MAX_DEPTH}, got {depth!r}")
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise UserError(f"head hidden_size must be a positive integer, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.depth = depth
        self.draft_model = draft_model
        self.draft_fingerprint = draft_fingerprint
        self.feature = feature
        self.inputs = inputs
        self.extra: dict = {}  # training metadata read back by from_pretrained
        self.in_dim = hidden_size + (N_STATS if reads_stats(inputs) else 0)  # the rows it is given
        width = N_STATS if inputs == "stats" else self.in_dim  # what its layers see
        if reads_stats(inputs):
            # how the datagen run processed q before taking its stats; the policy does the same
            self.stats_sampling = dict(stats_sampling or {})
            self.stats_params = sampling_from(self.stats_sampling)
            self.register_buffer("stats_mean", torch.zeros(N_STATS))
            self.register_buffer("stats_std", torch.ones(N_STATS))
        # A list comprehension, not [ResBlock(h)] * depth: each block needs its own weights.
        self.blocks = nn.ModuleList([ResBlock(width) for _ in range(depth)])
        self.out = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Input rows [..., in_dim] (see `inputs`) -> acceptance logits [...]."""
        if h.shape[-1] != self.in_dim:
            raise UserError(
                f"this acceptance head reads inputs={self.inputs} (rows of {self.in_dim}: hidden state"
                f"{' + 3 draft stats' if self.in_dim > self.hidden_size else ''}) but was given rows of "
                f"{h.shape[-1]}; build rows with heads.join_inputs / heads.shard_inputs, or use a head trained with "
                "inputs=hidden where only the hidden state is available")
        x = h.to(self.out.weight.dtype)
        if self.in_dim > self.hidden_size:
            H = self.hidden_size
            z = (x[..., H:] - self.stats_mean) / self.stats_std
            x = z if self.inputs == "stats" else torch.cat([x[..., :H], z], -1)
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)

    def acceptance_prob(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(h))

    def config_dict(self, extra: dict | None = None) -> dict:
        core = {"format": HEAD_FORMAT, "hidden_size": self.hidden_size, "depth": self.depth,
                "draft_model": self.draft_model, "draft_fingerprint": self.draft_fingerprint,
                "feature": self.feature, "inputs": self.inputs}
        if reads_stats(self.inputs):
            core["stats_sampling"] = self.stats_sampling
        return {**(extra or {}), **core}  # metadata never overrides the fields loading relies on

    # ------------------------------------------------------------------ saving (hub.HubModel)

    def generate_model_card(self, *args, **kwargs):
        return super().generate_model_card(*args, body=model_card(self), **kwargs)

    # ------------------------------------------------------------------ loading (hub.HubModel)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, hidden_size: int | None = None,
                        draft_model: str | None = None, device=None, dtype=None, **hub_kwargs) -> "AcceptanceHead":
        """A head from a local folder or a hub repo id (hub_kwargs: revision, token, cache_dir,
        local_files_only, force_download). `hidden_size` / `draft_model` describe the draft in
        use: a head trained for another hidden size is refused with a message naming both."""
        dtype = dtype if dtype is None or isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
        return cls._load(pretrained_model_name_or_path, device, dtype, hub_kwargs, draft_hidden_size=hidden_size,
                         draft_in_use=draft_model)

    @classmethod
    def _from_config(cls, cfg: dict | None, where: str, draft_hidden_size: int | None, draft_in_use: str | None):
        if cfg is None:
            raise UserError(f"acceptance head {where} has no {CONFIG_NAME}; it is not a saved head "
                            f"(or its export was interrupted); {cls._FIX}")
        try:
            h, depth = int(cfg["hidden_size"]), int(cfg["depth"])
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{where}/{CONFIG_NAME} is corrupt ({type(e).__name__}: {e}); re-export the head, "
                            f"{cls._FIX}") from None
        trained_for = cfg.get("draft_model")
        if draft_hidden_size is not None and int(draft_hidden_size) != h:
            in_use = f" '{draft_in_use}'" if draft_in_use else ""
            raise UserError(
                f"head at {where} was trained for draft model '{trained_for}' (hidden size {h}) but the draft in "
                f"use{in_use} has hidden size {draft_hidden_size}; pass the draft it was trained for or train a head "
                "for this draft")
        for key, known in (("feature", FEATURES), ("inputs", INPUTS)):
            if cfg.get(key) not in known:
                got = f"names {key} {cfg[key]!r}" if key in cfg else f"has no {key!r}"
                raise UserError(f"{where}/{CONFIG_NAME} {got}; this version reads {', '.join(known)}: add "
                                f'"{key}": "{known[0]}" to a head saved before it was recorded, upgrade adaptive_spec, '
                                f"or {cls._FIX}")
        return cls(h, depth, draft_model=trained_for, draft_fingerprint=cfg.get("draft_fingerprint"),
                   feature=cfg["feature"], inputs=cfg["inputs"], stats_sampling=cfg.get("stats_sampling"))


def model_card(head: AcceptanceHead) -> str:
    """The README of a saved head: what it reads and, for a trained one, its data and metrics."""
    reads = ("the state at the candidate's own position, as in the paper: scores arrive one draft step late"
             if head.feature == "token" else
             "the state that produced the candidate's distribution: scores it before it is fed, no lag")
    lines = [
        f"# Acceptance head: D={head.depth}" + (f", w_rej={head.extra['w_rej']:g}" if "w_rej" in head.extra else ""),
        "",
        f"A SpecDec++ acceptance-prediction head ({head.depth + 1}-layer ResNet, SiLU) on "
        + (f"the statistics of each candidate under the draft's own q, not a hidden state, for the draft "
           f"`{head.draft_model}` (hidden size {head.hidden_size}, fingerprint `{head.draft_fingerprint}`); "
           if head.inputs == "stats" else
           f"the final hidden state (size {head.hidden_size}) of the draft `{head.draft_model}` "
           f"(fingerprint `{head.draft_fingerprint}`); ")
        + f"feature `{head.feature}` ({reads}); inputs `{head.inputs}` ({_reads_inputs(head)}).",
        "It predicts P(draft token accepted | earlier ones accepted); the decoder stops drafting when "
        "1 - prod(p_hat) > h.",
        "",
        "```",
        "adaptive-spec generate --policy learned --head <this folder or hub id> --threshold 0.7 --prompt '...'",
        "```",
        "",
    ]
    return "\n".join(lines + (_training_card(head.extra) if "metrics" in head.extra else []))


def _reads_inputs(head: AcceptanceHead) -> str:
    if head.inputs == "hidden":
        return "the hidden state alone"
    s = head.stats_params
    which = "no hidden state, only" if head.inputs == "stats" else "the hidden state and"
    return (f"{which} the draft's statistics of the candidate: {', '.join(STATS)} "
            f"(adaptive_spec.heads.features.draft_stats, q at temperature {s.temperature:g}, top-k {s.top_k}, "
            f"top-p {s.top_p:g} as in its datagen run), standardized by the training set's mean and std")


def _training_card(extra: dict) -> list[str]:
    m = extra["metrics"]
    rows = [(k, m.get(f"train_{k}"), m.get(f"dev_{k}")) for k in ("loss", "kl", "auc", "ece")]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"
    g = lambda k, spec="": "?" if extra.get(k) is None else format(extra[k], spec)  # metadata of older heads may lack a key
    sources = extra.get("sources")
    by_source = extra.get("dev_by_source") or {}
    return [
        "## Training",
        f"- data: `{g('dataset')}` (datagen config hash `{g('dataset_config_hash')}`), "
        f"{g('n_train_positions', ',')} training positions "
        + ("(every draft token, states on the target's own prefix: datagen-features --prefix target)"
           if extra.get("prefix") == "target" else "(draft tokens only; token mixing r from the datagen config)")
        + (f"; prompt sources: {', '.join(map(str, sources))}" if sources else "")
        + ("; the shards datagen had written when training started (partial_data)" if extra.get("partial_data") else ""),
        f"- draft configuration: quantization {extra.get('draft_quant', 'none')}, vocabulary "
        f"{extra.get('draft_vocab', 'full')}",
        f"- target: `{g('target')}`; weighted BCE w_acc={g('w_acc', 'g')}, w_rej={g('w_rej', 'g')}",
        f"- {g('epochs')} epochs, batch {g('batch_size')}, lr {g('lr', 'g')} (Adam, cosine); "
        f"exported at step {g('step')} (lowest dev loss)",
        "",
        "## Metrics at export (KL = unweighted binary KL between target and prediction; AUC = chance an accepted "
        "token (P >= 0.99) is ranked above a rejected one; ECE = expected calibration error, "
        f"{extra.get('ece_bins', 10)} equal-width bins)",
        "| metric | train | dev |",
        "|---|---|---|",
        *[f"| {k} | {fmt(tr)} | {fmt(dv)} |" for k, tr, dv in rows],
        "",
        *(["Dev metrics per prompt source:", "", "| source | positions | KL | AUC | ECE |", "|---|---|---|---|---|",
           *[f"| {s} | {r.get('n', '?')} | {fmt(r.get('kl'))} | {fmt(r.get('auc'))} | {fmt(r.get('ece'))} |"
             for s, r in by_source.items()], ""] if by_source else []),
        "Reliability plot: `reliability.png`.",
        "",
    ]


def load_head(head, hidden_size: int | None = None, draft_model: str | None = None, device=None,
              dtype=torch.float32, feature: str | None = None, inputs: tuple[str, ...] = ("hidden",),
              why: str = "the learned policy"):
    """The one way to get a head for decoding: an AcceptanceHead (or anything with
    `acceptance_prob`) is returned as is; a folder (or hub id) is loaded and checked against the
    draft in use (`hidden_size`). `feature`: refuse a head that reads another feature; `inputs`:
    the input sets the caller can supply (refuse others); `why` names who asked, for the error."""
    if head is None or head == "":
        raise UserError(f"{why} needs a trained acceptance head: pass --head PATH (a folder written by "
                        "`adaptive-spec train`, e.g. checkpoints/qwen-coder-0.5b-d3-wrej6)")
    if not hasattr(head, "acceptance_prob"):
        head = AcceptanceHead.from_pretrained(head, hidden_size=hidden_size, draft_model=draft_model,
                                              device=device, dtype=dtype)
    got = getattr(head, "feature", "token")
    if feature is not None and got != feature:
        raise UserError(f"{why} needs a head trained with feature={feature}; this one reads feature={got}")
    got = getattr(head, "inputs", "hidden")
    if got not in inputs:
        raise UserError(f"{why} can supply inputs {' or '.join(inputs)} but this head was trained with inputs={got}; "
                        f"use a head trained with inputs={inputs[0]} (train.py ... inputs={inputs[0]})")
    return head.eval() if hasattr(head, "eval") else head


def join_inputs(hidden: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
    """A head's input rows: the hidden state [..., H], then the draft stats [..., 3] if it reads them.
    float32 either way, so bf16 states and float32 stats meet in one row without losing the stats."""
    return hidden.float() if stats is None else torch.cat([hidden.float(), stats.float()], -1)


def shard_inputs(head, shard: dict) -> torch.Tensor:
    """[T, in_dim] input rows of `head` for every response position of a datagen shard (shards.load_shard), built
    as training builds them (features.position_map): row i scores Y_i. Rows equal training's where
    `shard_positions` is True; elsewhere a token head's row holds the state after X_i and a context head's row at
    a response's first position is zeros."""
    feature, inputs = getattr(head, "feature", "token"), getattr(head, "inputs", "hidden")
    clean = CONTEXT_KEY in shard
    # a stats head reads no state: zeros keep the row layout, and token data alone serves
    feats = (torch.zeros(len(shard["loss_mask"]), head.hidden_size) if inputs == "stats"
             else shard.get(state_key(feature, clean)))
    if feats is None:
        raise UserError("the datagen shard has no stored draft features ('features'); regenerate the dataset with "
                        "store_features=true")
    T = feats.shape[0]
    used, row = position_map(feature, shard["loss_mask"], shard["resp_offsets"], clean)
    hidden = feats[row].float()
    if feature == "context":
        hidden[~used] = 0.0
    stats = None
    if reads_stats(inputs):
        stats = shard.get("draft_stats")
        if stats is None:
            raise UserError(f"a head with inputs={inputs} needs the draft statistics ('draft_stats') that the "
                            "current datagen stores, and this shard has none; regenerate the dataset with the current "
                            "`adaptive-spec datagen` (or use a head trained with inputs=hidden)")
        if tuple(stats.shape) != (T, N_STATS):
            raise UserError(f"draft_stats has shape {tuple(stats.shape)}, expected [{T}, {N_STATS}]; regenerate the "
                            "dataset")
    return join_inputs(hidden, stats)


def shard_positions(head, shard: dict) -> torch.Tensor:
    """[T] bool: the response positions where `shard_inputs` rows are exactly what training used."""
    return position_map(getattr(head, "feature", "token"), shard["loss_mask"], shard["resp_offsets"],
                        CONTEXT_KEY in shard)[0]
