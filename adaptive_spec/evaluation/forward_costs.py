"""What the benchmark scripts in eval/ share to time forwards, in one place (no script imports another).
Imports no torch itself (a script's --report-only path reads its labels from here).

`pass_times` is auto's own measurement (cost_timing.interleaved_times), so a benchmark's v(N) and auto's
are the same numbers taken the same way; timing.timed_runs is the torch benchmarks' one timing loop (warm-ups,
a reset before every call)."""
from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # llama.cpp is imported where a runner is made
    from ..backends.llamacpp import LlamaCppLM


def pass_times(runners: dict, lengths, reps: int, all_rows=(True,)) -> dict:
    """{(name, n, all_rows): median seconds} of a pass of n tokens after a cost_timing.PREFIX-token context (less where
    a runner's context cannot hold it), for every runner and length, with the logits of every row (True)
    or of the last only (False), interleaved (auto's interleaved_times)."""
    from ..decoding.auto import interleaved_times  # torch: only where something is timed

    cells = [(name, n, a) for name in runners for n in (lengths[name] if isinstance(lengths, dict) else lengths)
             for a in all_rows if a or n > 1]
    times = interleaved_times([(runners[name], n, a) for name, n, a in cells], reps)
    return dict(zip(cells, times))


def time_forward(lm, prompt, n: int, reps: int):
    """(median seconds of feeding n tokens after `prompt`, rolled back each time, after 3 warm-ups; the logits)."""
    import torch

    from ..timing import timed_runs  # torch: only where something is timed

    lm.reset()
    lm.forward(prompt, n_logits=0)
    base = lm.length
    ids = torch.arange(100, 100 + n) % lm.vocab_size
    times, (logits, _) = timed_runs(lambda: lm.forward(ids, n_logits=n), reps, warmup=3,
                                    before=lambda: lm.rollback(base))
    return statistics.median(times), logits


def time_prefill(lm, n: int, reps: int) -> float:
    """Median seconds of a prefill of n tokens into an empty cache (the first of reps + 1 untimed)."""
    import torch

    from ..timing import timed_runs

    ids = torch.arange(300, 300 + n) % lm.vocab_size
    times, _ = timed_runs(lambda: lm.forward(ids, n_logits=0), reps, warmup=1, before=lm.reset)
    return statistics.median(times)


def per_step_ms(fn, reps: int) -> float:
    """Mean milliseconds of fn() over `reps` calls after 10 warm-ups."""
    from ..timing import timed_runs

    return 1e3 * statistics.fmean(timed_runs(fn, reps, warmup=10)[0])


def read_bandwidth_gbps(gib: float = 1.0, reps: int = 5) -> float:
    """Best-of-reps GB/s of summing a buffer far larger than the caches: the ceiling a
    bandwidth-bound decode step can reach on this machine with torch's threads."""
    import torch

    from ..timing import timed_runs

    x = torch.ones(int(gib * (1 << 30) // 4), dtype=torch.float32)
    times, _ = timed_runs(x.sum, reps, warmup=1)
    return x.numel() * 4 / min(times) / 1e9


def linear_bytes(model) -> int:
    """Bytes of linear-layer weights a one-row step streams (a packed or quantized layer's own count)."""
    import torch

    from ..backends.cpu.packed import PackedLinear
    from ..backends.cpu.quant import QuantLinear

    seen, n = set(), 0
    for m in model.modules():
        if isinstance(m, (PackedLinear, QuantLinear)):  # their own byte count: the weight may be released
            n += getattr(m, "step_bytes", m.weight_bytes) if id(m) not in seen else 0
            seen.add(id(m))
        elif isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n += m.weight.numel() * m.weight.element_size()
    return n


STREAM_BYTES = 256 << 20  # copies of a small layer up to this size, so weights come from memory, not cache


def layer_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, count in the model) for a Llama/Qwen-style decoder: only its config
    is read ('target' / 'draft' of the default pair, a folder or a hub id)."""
    from transformers import AutoConfig

    from ..backends.paths import resolve_model_path

    role = model if model in ("target", "draft") else "target"
    c = AutoConfig.from_pretrained(resolve_model_path(None if model == role else model, role))
    h, n = c.hidden_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return {"q, o": (h, c.num_attention_heads * head_dim, 2 * n), "k, v": (h, kv, 2 * n),
            "gate, up": (h, c.intermediate_size, 2 * n), "down": (c.intermediate_size, h, n),
            "lm_head": (h, c.vocab_size, 1)}


def linear_kernels() -> dict:
    """name -> (bytes per weight, prepare(weight fp32) -> state, call(x, state)); only those this CPU can run:
    oneDNN packed (the runtime's path: packed.PackedLinear) in fp32 and, where the CPU has bf16 kernels,
    bf16; MKL packed sgemm; FBGEMM fp16 weights with fp32 activations (deprecated in torch, timed while it
    exists: half the bytes of fp32, fp32 arithmetic); stock `F.linear`, fp32 and bf16."""
    import torch

    from ..backends.cpu.machine import fbgemm_fp16, onednn_packed

    out = {}
    for dt in (torch.float32, torch.bfloat16):
        tag = "fp32" if dt == torch.float32 else "bf16"
        if not onednn_packed(dt):
            out[f"oneDNN packed {tag}"] = (
                dt.itemsize, lambda w, dt=dt: torch.ops.mkldnn._reorder_linear_weight(w.to(dt)),
                lambda x, s: torch.ops.mkldnn._linear_pointwise(x.to(s.dtype), s, None, "none", [], ""))
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out["MKL packed fp32"] = (4, lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w),
                                  lambda x, s: torch.ops.mkl._mkl_linear(x, s[0], s[1], None, x.shape[0]))
    if fbgemm_fp16() is None:  # the runtime's own check; models silences the ops' deprecation warning
        out["FBGEMM fp16 weights"] = (
            2, lambda w: (torch.fbgemm_pack_gemm_matrix_fp16(w), torch.zeros(w.shape[0])),
            lambda x, s: torch.fbgemm_linear_fp16_weight_fp32_activation(x, s[0], s[1]))
    out["stock fp32"] = (4, lambda w: w, lambda x, s: torch.nn.functional.linear(x, s))
    out["stock bf16"] = (2, lambda w: w.bfloat16(), lambda x, s: torch.nn.functional.linear(x.bfloat16(), s))
    return out


def _every_copy(call, x, states) -> None:
    """x through every copy of a layer: what linear_row_times times as one pass."""
    for s in states:
        call(x, s)


def linear_row_times(shapes: dict, kernels: dict, rows: list[int], rounds: int, reps: int) -> dict:
    """{(kernel, layer, rows): median ms of one layer}: random weights of each shape (copies of a small one up
    to STREAM_BYTES, so they stream from memory as a model's do), kernels and row counts alternating `rounds`
    times so machine drift hits all alike, one untimed pass before each `reps`."""
    import torch

    from ..timing import timed_runs

    gen = torch.Generator().manual_seed(0)
    ms = {}  # (kernel, shape, rows) -> [seconds per layer]
    with torch.inference_mode():
        for name, (i, o, _) in shapes.items():
            copies = max(1, STREAM_BYTES // (i * o * 4))
            ws = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(copies)]
            states = {k: [prep(w) for w in ws] for k, (_, prep, _) in kernels.items()}
            xs = {m: torch.randn(m, i, generator=gen) for m in rows}
            for _ in range(rounds):
                for k, (_, _, call) in kernels.items():
                    for m in rows:
                        times, _ = timed_runs(functools.partial(_every_copy, call, xs[m], states[k]), reps, warmup=1)
                        ms.setdefault((k, name, m), []).extend(t / copies for t in times)
            del ws, states
    return {key: statistics.median(v) * 1e3 for key, v in ms.items()}


def draft_label(spec: str) -> str:
    base, at, rest = spec.partition("@")
    return ("unquantized" if base == "none" else base) + at + rest


def gguf_file(role: str, quant: str) -> Path:
    """The default pair's fetched GGUF file of `role` ("target" / "draft"), re-quantized to `quant` unless "none"."""
    from ..setup.wheels import default_gguf
    from ..backends.llamacpp_pair import requantized_gguf

    src = default_gguf(role)
    return src if quant == "none" else requantized_gguf(src, quant)


def draft_runner(spec: str, threads: int, n_ctx: int = 1024) -> LlamaCppLM:
    """A llama.cpp draft named QUANT or QUANT:N (N: --draft-vocab, the draft's GGUF cut to the N most frequent
    tokens)."""
    from ..backends.llamacpp import GGUFModel, LlamaCppLM
    from ..backends.llamacpp_pair import gguf_tokens_digest, reduced_vocab_draft
    from ..backends.paths import split_draft_config

    quant, vocab = split_draft_config(spec)
    path, maps = gguf_file("draft", quant), {}
    if vocab:
        path, maps = reduced_vocab_draft(path, vocab, _tokenizer(), gguf_tokens_digest(path)[0])
    return LlamaCppLM(GGUFModel(path), n_ctx=n_ctx, n_threads=threads, **maps)


@functools.cache
def _tokenizer():
    """The default pair's tokenizer (the list of kept tokens is counted with it)."""
    from transformers import AutoTokenizer

    from ..backends.paths import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("default", "target"))


def held_sequences(n_prompts: int, n_tokens: int):
    """(the fetched target's pair, [(prompt ids, its greedy continuation)], the target's log-probabilities
    along each): held prompts (HumanEval and, where present, GSM8K / AlpacaEval), teacher-forced."""
    from ..backends.engines import CPU_BASELINE
    from ..decoding.pipeline import SpecPair
    from ..prompts import load_prompts

    base = SpecPair.load(backend=CPU_BASELINE, draft=None)  # the engine whose passes are measured
    prompts = []
    for ds in ("humaneval", "gsm8k", "alpaca"):
        try:
            prompts += load_prompts(ds, n=n_prompts, seed=5)
        except Exception:  # noqa: BLE001  (the shared sets may be absent on a clone)
            continue
    seqs = []
    for p in prompts:
        ids = base.encode(p, chat=True)
        g = base.generate(ids, policy="ar", temperature=0, max_new_tokens=n_tokens)
        seqs.append((ids, g.token_ids))
    return base, seqs, [logprobs(base.target, ids, new) for ids, new in seqs]


def logprobs(lm, ids, new):
    """`lm`'s log-probabilities of each token of `new` after `ids`, teacher-forced in one pass."""
    import torch

    lm.reset()
    logits, _ = lm.forward(torch.tensor(ids + new[:-1]), n_logits=len(new))
    return logits.float().log_softmax(-1)


def against_fetched(lm, held, per_token) -> tuple[float, float, int]:
    """(per_token(reference log-probs, lm's) summed over the held tokens / tokens, argmax agreement, tokens):
    `lm` teacher-forced along the fetched target's greedy continuations (held_sequences)."""
    _, seqs, ref = held
    total, agree, n = 0.0, 0, 0
    for (ids, new), lp_ref in zip(seqs, ref):
        lp = logprobs(lm, ids, new)
        total += float(per_token(lp_ref, lp))
        agree += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
        n += len(new)
    return total / n, agree / n, n


def target_quality(quants: list[str], held) -> dict:
    """{quant: (mean KL(fetched || re-quantized) nats, top-1 agreement, tokens)} of each re-quantized target."""
    from ..backends.llamacpp import GGUFModel, LlamaCppLM

    base = held[0]
    kl = lambda ref, lp: (ref.exp() * (ref - lp)).sum()  # noqa: E731
    return {q: against_fetched(LlamaCppLM(GGUFModel(gguf_file("target", q)), n_ctx=base.target.max_length,
                                          n_threads=base.target.n_threads), held, kl) for q in quants}


def draft_acceptance(drafts: list[str], held, threads: int) -> dict:
    """{draft: (expected acceptance at T = 1, greedy agreement, tokens)}: along the fetched target's greedy
    continuations, E[alpha] = sum_x min(p(x), q(x)) per position (the chance a T = 1 draft token is
    accepted) and how often the draft's argmax is the target's; a reduced vocabulary's q is 0 on the
    dropped tokens, so what it loses in acceptance shows beside what it saves per step (pass_times)."""
    base = held[0]
    alpha = lambda ref, lq: ref.exp().minimum(lq.exp()).sum()  # noqa: E731
    return {spec: against_fetched(draft_runner(spec, threads, n_ctx=base.target.max_length), held, alpha)
            for spec in drafts}

