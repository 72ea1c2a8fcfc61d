"""The feature drafter in decoding: the target's hidden states recorded as it runs (HiddenTap), and the drafter
on the runner contract (FeatureRunner), so the draft model's source (decoder.ModelSource) drives it and every
chain policy runs with it unchanged.

Position bookkeeping. Token x_p sits at position p. The drafter's KV slot s holds the pair (f_s, x_{s+1}),
whose output is f^_{s+1}, read out as the distribution of x_{s+2}; x_0 has no slot. Slot s needs f_s: the
target's own (HiddenTap) where the target has kept position s, otherwise f^_s, the drafter's output of slot
s - 1. A slot fed with f^ is re-fed once the target's f_s arrives (after the round that verified x_s), as
EAGLE does: drafts always start from the target's real states. Which state a slot reads changes only the
proposals q, never the verification: the output stays exactly the target's.

The target's verify pass already computes the final hidden state of every row it feeds; the tap keeps the
rows (runner.forward_hidden) and forgets those past a rollback, so what it holds is always the states of the
accepted prefix, and the decoder is untouched.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..backends.contract import Counters
from ..backends.paths import FEATURE, FeatureDraft
from ..errors import UserError
from ..timing import timed
from .model import FeatureDrafter, Readout


class HiddenTap:
    """A target runner that also keeps the final hidden state of every position it holds (rows [length, H]).

    Everything else is the wrapped runner's (attributes are read through), so the decoder, the cost
    measurement and the policies see the same target."""

    def __init__(self, runner):
        self.runner = runner
        self._rows: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self.runner, name)

    @property
    def length(self) -> int:
        return self.runner.length

    def forward(self, ids: torch.Tensor, n_logits: int = 1):
        logits, rows = self.forward_hidden(ids, n_logits)
        return logits, rows[-1]

    def forward_epilogue(self, ids: torch.Tensor, n_logits: int, epilogue, with_head: bool = False):
        """A device round's verification (decoding/graph_round.py) after the tapped forward (the runner's
        forward_hidden: its rows step, graphed where warmed), not inside the runner's graph with the step."""
        logits, hidden = self.forward(ids, n_logits)
        return epilogue(logits, hidden, None)

    def forward_hidden(self, ids: torch.Tensor, n_logits: int = 1):
        start = self.runner.length
        logits, rows = self.runner.forward_hidden(ids, n_logits)
        self._keep(start, rows)
        return logits, rows

    def _keep(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if self._rows is None or self._rows.shape[0] < end:
            grown = rows.new_zeros(max(2 * end, 64), rows.shape[-1])
            if self._rows is not None:
                grown[: self._rows.shape[0]] = self._rows
            self._rows = grown
        self._rows[start:end] = rows

    def features(self, start: int, end: int) -> torch.Tensor:
        """The target's final hidden states of positions start..end-1 (all < length)."""
        if end > self.runner.length:
            raise ValueError(f"the target holds {self.runner.length} positions, asked for up to {end}")
        return self._rows[start:end]

    def rollback(self, length: int) -> None:
        self.runner.rollback(length)  # rows past the target's length are stale: never read (features checks)

    def reset(self) -> None:
        self.runner.reset()

    def fresh(self) -> "HiddenTap":
        return HiddenTap(self.runner.fresh())


class FeatureRunner:
    """The feature drafter on the runner contract (backends/contract.py): forward(ids, n_logits) feeds tokens,
    the features come from the tap (or the drafter's own predictions past the target's length)."""

    def __init__(self, drafter: FeatureDrafter, readout: Readout, tap: HiddenTap | None):
        self.drafter = drafter.eval()
        self.readout = readout
        self.tap = tap
        self.vocab_size = readout.vocab_size
        self.hidden_size = drafter.hidden_size
        self.device = drafter.device
        self.config = drafter.config_obj
        self.max_length = getattr(self.config, "max_position_embeddings", None)
        self.counters = Counters()
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.cache = DynamicCache(config=self.config)
        self.slots = 0  # KV slots held (= max(0, len(tokens) - 1))
        self.real = 0  # the leading slots fed with the target's own states
        self._outs = torch.zeros(64, self.hidden_size, dtype=self.drafter.dtype, device=self.device)  # f^ per slot

    @property
    def length(self) -> int:
        return len(self.tokens)

    def rollback(self, length: int) -> None:
        if length < len(self.tokens):
            del self.tokens[length:]
            self._crop(max(0, length - 1))

    def _crop(self, slots: int) -> None:
        if slots < self.slots:
            self.cache.crop(slots - self.slots)  # negative: drop that many trailing slots
            self.slots = slots
            self.real = min(self.real, slots)

    def _known(self) -> int:
        """Positions whose target state the tap holds."""
        return self.tap.length if self.tap is not None else 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        with timed(self.device) as t:
            self.tokens.extend(int(x) for x in ids.reshape(-1).tolist())
            if self.real < self.slots and self._known() > self.real:
                self._crop(self.real)  # slots fed with f^ where the target's f now exists: feed them again
            self._feed(len(self.tokens) - 1)
            n = len(self.tokens)
            rows = [self._outs[p - 1] if p >= 1 else self._outs.new_zeros(self.hidden_size)
                    for p in range(n - n_logits, n)]
            f = torch.stack(rows) if rows else self._outs.new_zeros(0, self.hidden_size)
            logits = self.readout.logits(f) if n_logits else f.new_zeros(0, self.vocab_size, dtype=torch.float32)
            hidden = self._outs[n - 2] if n >= 2 else self._outs.new_zeros(self.hidden_size)
        self.counters.add(t.s)
        return logits, hidden

    def _feed(self, want: int) -> None:
        """Compute slots self.slots..want-1: a run of slots whose f_s the target holds in one pass, each
        later one with the previous slot's f^ (a draft step feeds one)."""
        while self.slots < want:
            s0, known = self.slots, self._known()
            if s0 < known:
                s1 = min(want, known)
                feats = self.tap.features(s0, s1)
                real = True
            else:
                s1 = s0 + 1
                feats = self._outs[s0 - 1: s0] if s0 >= 1 else self._outs.new_zeros(1, self.hidden_size)
                real = False
            self._run(s0, s1, feats)
            if real and self.real == s0:
                self.real = s1

    def _run(self, s0: int, s1: int, feats: torch.Tensor) -> None:
        toks = torch.tensor(self.tokens[s0 + 1: s1 + 1], device=self.device)
        emb = self.readout.embed(toks)
        pos = torch.arange(s0, s1, device=self.device).view(1, -1)
        out = self.drafter(feats.view(1, s1 - s0, -1).to(self.drafter.dtype), emb.view(1, s1 - s0, -1), pos,
                           cache=self.cache, use_cache=True)
        f = self.readout.feature(out[0]).to(self._outs.dtype)
        if self._outs.shape[0] < s1:
            grown = self._outs.new_zeros(2 * s1, self.hidden_size)
            grown[: self._outs.shape[0]] = self._outs
            self._outs = grown
        self._outs[s0:s1] = f
        self.slots = s1

    def fresh(self) -> "FeatureRunner":
        return FeatureRunner(self.drafter, self.readout, self.tap.fresh() if self.tap is not None else None)

    def fingerprint(self) -> str:
        from ..backends.runner import model_fingerprint

        return "feature-" + model_fingerprint(self.drafter.base)

    def numeric_path(self) -> dict:
        return {"dtype": str(self.drafter.dtype), "drafter": "feature"}


def feature_pair(target_runner, target_model, drafter: FeatureDrafter, kept_ids=None, kv_cache: str = "dynamic",
                 runtime: str = "eager", max_cache_len: int | None = None, warm: bool = True):
    """(the tapped target, the drafter's runner) over a loaded target runner and its model: the static drafter
    (static.py) for the static KV cache or a graph runtime (warmed up now unless `warm` is false: a pair whose
    `prepare` warms it), as the target's runner is chosen, FeatureRunner otherwise."""
    if drafter.hidden_size != target_model.config.hidden_size:
        raise UserError(f"feature drafter trained for '{drafter.target_model}' (hidden size {drafter.hidden_size}) "
                        f"does not fit this target (hidden size {target_model.config.hidden_size}); pass the target it "
                        "was trained for")
    if not hasattr(target_runner, "forward_hidden"):
        raise UserError(f"a feature drafter reads the target's hidden states, which the {type(target_runner).__name__} "
                        "runner does not return; use --backend torch")
    tap = HiddenTap(target_runner)
    p = next(target_model.parameters())
    readout = Readout(target_model, target_runner.vocab_size, kept_ids)
    drafter = drafter.to(device=p.device, dtype=p.dtype)
    if kv_cache != "static" and runtime == "eager":
        return tap, FeatureRunner(drafter, readout, tap)
    from .static import StaticFeatureRunner

    runner = StaticFeatureRunner(drafter, readout, tap, max_cache_len, runtime)
    if warm:
        runner.warmup()
    return tap, runner


def load_drafter(spec: FeatureDraft | str, hidden_size: int | None = None) -> FeatureDrafter:
    """A FeatureDraft, `feature:PATH` or PATH (a folder or hub id) -> the drafter."""
    path = spec.path if isinstance(spec, FeatureDraft) else str(spec).removeprefix(FEATURE)
    return FeatureDrafter.from_pretrained(path, hidden_size=hidden_size)


def readout_vocab(drafter: FeatureDrafter, asked=None) -> str:
    """The vocabulary a drafter reads out over: `--draft-vocab` where given, else the one its cross-entropy was
    trained on (training's ce_vocab, kept in its config), else the whole."""
    return str(asked if asked is not None else drafter.extra.get("ce_vocab") or "full")


def drafter_over(target_runner, target_model, tok, drafter: FeatureDrafter, asked=None, **runner_kw):
    """(the tapped target, the drafter's runner, the vocabulary it reads out over: readout_vocab); runner_kw:
    feature_pair's kv_cache, runtime, max_cache_len and warm."""
    from ..backends.vocab import resolve_draft_vocab

    vocab = readout_vocab(drafter, asked)
    kept = resolve_draft_vocab(vocab, tok, target_runner.vocab_size)
    return (*feature_pair(target_runner, target_model, drafter, kept, **runner_kw), vocab)


def load_feature_pair(params):
    """The pair `--draft feature:PATH` names (params.draft a FeatureDraft; the torch engine, an unquantized
    draft: the settings' checks): the target's runner behind a HiddenTap, and the drafter over the target's
    embedding, norm and LM head (`--draft-vocab` reduces its output as for a draft)."""
    from ..backends import torch_engine
    from ..backends.contract import Loaded
    from ..backends.models import load_model
    from ..backends.runner import resolve_device
    from ..backends.static_runner import make_runner
    from ..prompts import eos_token_ids
    from .static import StaticFeatureRunner

    device = resolve_device(params.device)
    kv_cache, runtime = torch_engine.runtime_for(params.kv_cache, params.runtime, device)
    if params.threads:
        torch.set_num_threads(params.threads)
    target_model, tok = load_model(params.target, "target", params.dtype, device, **params.cpu_kernels())
    target = make_runner(target_model, None, kv_cache, runtime, params.max_cache_len)
    drafter = load_drafter(params.draft, hidden_size=target_model.config.hidden_size)
    tap, runner, vocab = drafter_over(target, target_model, tok, drafter, params.draft_vocab, kv_cache=kv_cache,
                                      runtime=runtime, max_cache_len=params.max_cache_len, warm=False)
    config = {"draft_quant": "none", "draft_vocab": vocab, "drafter": "feature"}
    # graph runtimes: the target's verify shapes warmed for forward_hidden (the variant the tap calls), and the
    # drafter's step with the head in its graph once a policy brings one, before any timed decode
    graphed = runner if isinstance(runner, StaticFeatureRunner) else None
    prepare = torch_engine.graph_warmup(target, graphed, runtime, rows=True) if runtime != "eager" else None
    return Loaded(tap, runner, tok, eos_token_ids(tok, target_model), config, prepare=prepare)
