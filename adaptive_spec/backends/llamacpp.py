"""The llama.cpp engine: a GGUF model behind the runner contract, through llama-cpp-python's low-level API.
Rejection sampling stays ours, so the output is exactly the target's distribution whatever llama.cpp
computes inside a pass. llama.cpp gives no hidden state: `hidden` is a zero vector (a statistics head
ignores it), and the policies that need one are refused by the engine's record. The binding is optional
and built once per kind of CPU (setup/llama_build.py)."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .contract import Counters
from ..setup.llama_build import install_command, missing_instructions
from .paths import file_fingerprint

log = logging.getLogger(__name__)

INSTALL_HINT = install_command() + "; it compiles llama.cpp once for this CPU, about 5 minutes on 2 cores"
DEFAULT_N_CTX = 4096

_init_lock = threading.Lock()
_initialised = False
_log_cb = None  # the ctypes callback must outlive every call into llama.cpp


def import_llama_cpp():
    """The binding's low-level module, or a UserError naming the install command."""
    try:
        import llama_cpp  # optional: the [llama] extra, compiled per CPU
    except ImportError as e:
        raise UserError(f"the llama.cpp backend needs llama-cpp-python, which is not installed here ({e}); "
                        f"install it with: {INSTALL_HINT}") from None
    except OSError as e:  # the shared library is there but does not load
        raise UserError(f"llama-cpp-python is installed but its library does not load ({e}); reinstall it with: "
                        f"{INSTALL_HINT}") from None
    return llama_cpp


def available() -> str | None:
    """None when the binding imports, else why not (the engine record's check; tests skip with it)."""
    try:
        import_llama_cpp()
    except UserError as e:
        return str(e)
    return None


def init_library(ll) -> None:
    """Once per process: the backend, and llama.cpp's log routed to Python logging: errors as errors, warnings
    at debug level (GGUF quirks that would bury the one line a user needs), the rest dropped."""
    global _initialised, _log_cb
    with _init_lock:
        if _initialised:
            return

        @ll.llama_log_callback
        def _cb(level, text, _user):
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
                msg = text.decode("utf-8", "replace").rstrip()
                if msg:
                    log.log(logging.DEBUG if level == 3 else logging.ERROR, "llama.cpp: %s", msg)

        _log_cb = _cb
        ll.llama_log_set(_log_cb, ctypes.c_void_p())
        ll.llama_backend_init()
        # a library built for instructions this CPU lacks dies on the first one it meets: refuse it now
        missing = missing_instructions(ll.llama_print_system_info().decode(errors="replace"))
        if missing:
            raise UserError(f"this llama-cpp-python was compiled for {', '.join(missing)}, which this CPU lacks "
                            f"(a .venv made on another machine?); rebuild it for this CPU: {INSTALL_HINT}")
        _initialised = True


def load_model_file(path: Path, unreadable: str, vocab_only: bool = False):
    """(the initialised binding, llama.cpp's model pointer: the caller frees it) of a GGUF file on the CPU; a
    UserError for a missing file, or `unreadable` for one llama.cpp does not load."""
    ll = import_llama_cpp()
    init_library(ll)
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    params.vocab_only = vocab_only
    ptr = ll.llama_model_load_from_file(str(path).encode(), params)
    if not ptr:
        raise UserError(unreadable)
    return ll, ptr


class GGUFModel:
    """One loaded GGUF model (weights only); contexts (`LlamaCppLM`) are made on it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.ll, self.ptr = ll, ptr = load_model_file(
            self.path, f"llama.cpp could not load {self.path} (corrupt, truncated, or an architecture this llama.cpp "
                       "does not know); fetch the file again")
        self._finalizer = weakref.finalize(self, ll.llama_model_free, ptr)
        vocab = ll.llama_model_get_vocab(ptr)
        self.vocab_size = int(ll.llama_vocab_n_tokens(vocab))
        self.hidden_size = int(ll.llama_model_n_embd(ptr))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(ptr))
        self.n_params = int(ll.llama_model_n_params(ptr))
        self.n_bytes = int(ll.llama_model_size(ptr))
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(ptr, buf, 256)
        self.desc = buf.value.decode(errors="replace")
        self.name_or_path = str(self.path)

    def fingerprint(self) -> str:
        return file_fingerprint(self.path)


class LlamaCppLM:
    """A llama.cpp context with the `CausalLM` runner interface."""

    def __init__(self, model: GGUFModel | str | Path, n_ctx: int | None = None, n_threads: int | None = None,
                 n_batch: int = 512, vocab_size: int | None = None, kept_ids=None, input_map=None):
        """kept_ids / input_map: a reduced-vocabulary draft file's two maps (gguf_vocab.reduced_draft_gguf)."""
        self.model = model if isinstance(model, GGUFModel) else GGUFModel(model)
        ll = self.ll = self.model.ll
        self.n_threads = int(n_threads or torch.get_num_threads() or os.cpu_count() or 1)
        n_ctx = int(n_ctx or min(DEFAULT_N_CTX, self.model.n_ctx_train or DEFAULT_N_CTX))
        self.n_batch = int(min(n_batch, n_ctx))
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, self.n_batch, self.n_batch, 1
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.no_perf = True
        ctx = ll.llama_init_from_model(self.model.ptr, cp)
        if not ctx:
            raise UserError(f"llama.cpp could not make a context of {n_ctx} positions for {self.model.path.name} "
                            "(out of memory?); pass a smaller --n-ctx")
        self.ctx = ctx
        # self.model keeps the weights alive as long as any context made on them
        self._finalizer = weakref.finalize(self, ll.llama_free, ctx)
        self.mem = ll.llama_get_memory(ctx)
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self._batch_finalizer = weakref.finalize(self, ll.llama_batch_free, self.batch)
        # numpy views of the batch's arrays: filling a chunk is three vectorized writes, no per-token ctypes
        self._tok = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.n_batch,))[:] = 1
        for j in range(self.n_batch):
            self.batch.seq_id[j][0] = 0
        self.n_vocab = self.model.vocab_size  # rows of its output matrix
        self.input_map = None if input_map is None else np.asarray(input_map, dtype=np.int32)
        # a reduced file's full-vocabulary id per row, sorted (CausalLM's attribute for the same thing)
        self.kept_ids = None if kept_ids is None else torch.as_tensor(np.asarray(kept_ids), dtype=torch.long)
        if (self.kept_ids is None) != (self.input_map is None) or (
                self.kept_ids is not None and len(self.kept_ids) != self.n_vocab):
            raise ValueError(f"a reduced-vocabulary file needs both maps, kept_ids of its {self.n_vocab} rows")
        self.full_vocab = self.n_vocab if self.input_map is None else len(self.input_map)
        self.vocab_size = int(vocab_size or self.full_vocab)
        if self.vocab_size > self.full_vocab:
            raise UserError(f"vocab_size {self.vocab_size} exceeds {self.model.path.name}'s {self.full_vocab} tokens")
        self.hidden_size = self.model.hidden_size
        self.max_length = n_ctx  # the context's positions (CausalLM's name for the limit)
        self.device = torch.device("cpu")
        self._zero_hidden = torch.zeros(self.hidden_size)
        self.counters = Counters()
        self.length = 0

    def fresh(self) -> "LlamaCppLM":
        """Another context on the same weights (its own empty cache): for work beside a running decode."""
        return LlamaCppLM(self.model, n_ctx=self.max_length, n_threads=self.n_threads, n_batch=self.n_batch,
                          vocab_size=self.vocab_size, kept_ids=self.kept_ids, input_map=self.input_map)

    def reset(self):
        self.ll.llama_memory_clear(self.mem, True)
        self.length = 0

    def forward(self, ids, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One llama_decode per chunk of n_batch tokens, logits asked only for the rows a caller reads."""
        ids = np.asarray(ids.tolist() if isinstance(ids, torch.Tensor) else ids, dtype=np.int32).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self.input_map is not None:
            ids = self.input_map[ids]  # a reduced-vocabulary file: each id's row (a dropped one: its nearest)
        if self.length + n > self.max_length:
            raise UserError(f"{self.length + n} positions exceed the llama.cpp context of {self.max_length}; "
                            "pass a larger --n-ctx or a shorter prompt")
        n_logits = max(0, min(int(n_logits), n))
        t0 = time.perf_counter()
        rows = []
        first_out = n - n_logits
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            self._tok[:m] = ids[start:start + m]
            self._pos[:m] = np.arange(self.length + start, self.length + start + m, dtype=np.int32)
            want = np.arange(start, start + m) >= first_out
            self._out[:m] = want
            self.batch.n_tokens = m
            rc = self.ll.llama_decode(self.ctx, self.batch)
            if rc != 0:
                # the cache may hold part of this batch: crop it back to the last good length
                self.ll.llama_memory_seq_rm(self.mem, 0, self.length, -1)
                raise RuntimeError(f"llama_decode failed ({rc}) on {m} tokens at position {self.length + start}")
            k = int(want.sum())
            if k:
                ptr = self.ll.llama_get_logits(self.ctx)
                out = np.ctypeslib.as_array(ptr, shape=(k, self.n_vocab))
                rows.append(out[:, :self.vocab_size].copy() if self.kept_ids is None else self._spread(out))
        self.length += n
        logits = (torch.from_numpy(np.concatenate(rows) if len(rows) > 1 else rows[0]) if rows
                  else torch.empty(0, self.vocab_size))
        self.counters.add(time.perf_counter() - t0)
        return logits, self._zero_hidden

    def _spread(self, out: np.ndarray) -> np.ndarray:
        """A reduced file's logits over the full vocabulary, -inf (q = 0) on every dropped id, as CausalLM's
        (runner.spread_kept_logits; vocab_size may be set after construction, so the crop is made here)."""
        from .runner import spread_kept_logits  # noqa: PLC0415 (runner imports transformers: only for this file)

        kept = self.kept_ids[self.kept_ids < self.vocab_size]
        return spread_kept_logits(torch.from_numpy(out), kept, self.vocab_size).numpy()

    def rollback(self, length: int):
        if length < self.length:
            if not self.ll.llama_memory_seq_rm(self.mem, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not crop its cache to {length} positions")
            self.length = length

    def numeric_path(self) -> dict:
        """What a measurement on this runner depends on (recorded with every row, hashed into cost keys)."""
        ll = self.ll
        return {"engine": "llama.cpp", "llama_cpp_python": getattr(import_llama_cpp(), "__version__", "?"),
                "gguf": self.model.path.name, "desc": self.model.desc, "bytes": self.model.n_bytes,
                "threads": self.n_threads, "n_ctx": self.max_length,
                "system": ll.llama_print_system_info().decode(errors="replace").strip()}

    def fingerprint(self) -> str:
        return self.model.fingerprint()
