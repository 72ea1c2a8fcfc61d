"""What a datagen run is asked for: DatagenConfig (every key checked before a model loads), how it is stored
in the manifest, and the hash of what it generates, which names a run's shards and its cached features."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field

from ..config import Config
from ..decoding.sampling import SamplingParams
from ..errors import UserError
from ..params import PairParams
from ..prompts import EVAL_SETS, TRAINING_SETS
from ..runs import project_path
from .shards import SPLITS

WORK_ORDER = ("dev", "test", "train")  # the small evaluation splits first: a partial run is already usable
# Keys that cannot change what is generated: a resume may change them freely.
UNHASHED_KEYS = ("name", "out_dir", "overwrite", "threads", "progress")
# What a head is trained for: a run of one draft configuration is never resumed with another.
DRAFT_KEYS = ("draft", "draft_quant", "draft_vocab")
# The pair's settings as the manifest's config (format v1) stores them: flat, and unset ones spelled as
# they always were, so that a run's config hash, which names its shards and cached features, holds.
STORED_PAIR = ("draft", "target", "dtype", "draft_quant", "draft_vocab", "device", "threads")
STORED_UNSET = {"draft_vocab": "", "device": "auto", "threads": 0}
# settings of the pair that datagen does not read (it runs the torch engine with dynamic caches)
UNREAD_PAIR = ("backend", "n_ctx", "kv_cache", "runtime", "max_cache_len")
SOURCE_KEYS = ("name", "n", "field")


class DatagenConfig(Config):
    name: str = ""  # names the default out_dir runs/datagen/<name>; defaults to the config file's stem
    # prompts: a named set of adaptive_spec.prompts (gsm8k-train, alpaca, humaneval, sharegpt, ...),
    # a local .json/.jsonl file, or a hub dataset
    dataset: str = ""
    # ... or a mix of named training sets, each drawn and split on its own (dev prompts per source):
    # [{name: sharegpt, n: 2400}, {name: mbpp}]; n = prompts taken from the set (-1 or absent: all),
    # field = its text field (absent: the set's own). Set `dataset` or `sources`, not both.
    sources: list[dict | str] = Field(default_factory=list)
    dataset_config: str | None = None  # hub dataset configuration, e.g. "main" for gsm8k
    dataset_split: str = "train"  # the hub dataset's own split that prompts are read from
    prompt_field: str = ""  # "" = the named set's own field, else the first of prompt/instruction/question/text
    # our train/dev/test split, by a hash of the prompt text (stable across runs and machines)
    train_frac: float = 0.8
    dev_frac: float = 0.1
    test_frac: float = 0.1
    # caps per split (per source in a mix), taking the split's prompts in order: -1 = all, 0 = skip the split
    max_train_prompts: int = -1
    max_dev_prompts: int = -1
    max_test_prompts: int = -1
    max_prompt_tokens: int = 1024  # longer prompts are dropped (before the caps)
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template when it has one
    # the models, as `generate` takes them (params.PairParams): pair: {draft_quant: int8, dtype: auto, threads: 2};
    # heads should be trained on the draft configuration they serve
    pair: PairParams = Field(default_factory=PairParams)
    target_device_map: str = ""  # e.g. "auto": spread the target over the visible GPUs
    # sampling: p and q are both processed with these (as in decoding)
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_at_eos: bool = True  # a response ends with (and includes) the first EOS
    batch_size: int = 8
    shard_size: int = 64  # prompts per shard file: the unit of resume
    mix_ratio: float = 0.15  # r: share of response positions that keep the target token X_i
    seed: int = 0
    store_features: bool = True
    # output and running
    out_dir: str = ""  # default runs/datagen/<name>, relative to the project root
    overwrite: bool = False  # start over in an out_dir that holds a run with another config
    progress: bool = True

    def validate(self) -> None:
        if not self.dataset and not self.sources:
            raise UserError("config keys 'dataset' and 'sources' are both empty; set 'dataset' to a named prompt set "
                            "(gsm8k-train, alpaca, humaneval, sharegpt, ...), a .json/.jsonl file or a hub dataset "
                            f"name, or 'sources' to a mix of {', '.join(TRAINING_SETS)}")
        unread = [f"pair.{k}" for k in UNREAD_PAIR if getattr(self.pair, k) != PairParams.model_fields[k].default]
        if unread or self.pair.draft is None:
            raise UserError(f"{', '.join(unread) or 'pair.draft'}: datagen runs a draft and the target on the torch "
                            "engine with dynamic caches; name the draft, and drop the engine settings")
        if self.dataset and self.sources:
            raise UserError("config keys 'dataset' and 'sources' are both set; keep one (dataset: one prompt set, "
                            "sources: a mix of sets)")
        self.sources = [_source_entry(s) for s in self.sources]
        names = [s["name"] for s in self.sources]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise UserError(f"config key 'sources' lists {twice!r} twice; list each prompt set once")
        if self.sources and self.prompt_field:
            raise UserError("config key 'prompt_field' belongs to 'dataset'; in 'sources' give the entry its own "
                            "field, e.g. {name: my.jsonl, field: text}, and leave prompt_field empty")
        fr = (self.train_frac, self.dev_frac, self.test_frac)
        if any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
            raise UserError(f"train_frac + dev_frac + test_frac must be 1 with none negative, got {fr}")
        if not 0.0 <= self.mix_ratio <= 1.0:
            raise UserError(f"mix_ratio must be in [0, 1], got {self.mix_ratio}")
        for key in ("batch_size", "shard_size", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be >= 1, got {getattr(self, key)}")
        for s in SPLITS:
            if getattr(self, f"max_{s}_prompts") < -1:
                raise UserError(f"max_{s}_prompts must be -1 (all), 0 (skip) or a positive cap")
        self.sampling()  # SamplingParams refuses bad values

    def sampling(self):
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def resolved_out_dir(self) -> Path:
        return project_path(self.out_dir or f"runs/datagen/{self.name or 'datagen'}")

    def stored(self) -> dict:
        """The config as the manifest stores it (STORED_PAIR: the pair's settings flat)."""
        d = self.model_dump()
        pair = d.pop("pair")
        return {**d, **{k: STORED_UNSET.get(k) if pair[k] is None else pair[k] for k in STORED_PAIR}}

    @classmethod
    def from_stored(cls, stored: dict) -> "DatagenConfig":
        """The config of a manifest (stored()); keys this version does not have are left out."""
        names = cls.model_fields
        pair = {k: stored[k] for k in STORED_PAIR if stored.get(k) not in (None, STORED_UNSET.get(k))}
        return cls(**{k: v for k, v in stored.items() if k in names}, pair=PairParams(**pair))

    def source_list(self) -> list[dict]:
        """The prompt sources as `sources` entries: `dataset` alone is a one-source mix taking all."""
        return self.sources or [{"name": self.dataset, "n": -1, "field": self.prompt_field}]


def _source_entry(s) -> dict:
    """One `sources` entry checked, in the canonical form {name, n, field}: defaults filled in, so
    `{name: mbpp}` and `{name: mbpp, n: -1}` hash alike and resume each other's runs."""
    valid = f"valid names: {', '.join(TRAINING_SETS)}, or a local .json/.jsonl file"
    if isinstance(s, str):
        s = {"name": s}
    if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not s["name"].strip():
        raise UserError(f"config key 'sources' takes entries like {{name: sharegpt, n: 3000}}, got {s!r}; {valid}")
    name = s["name"].strip()
    unknown = sorted(set(s) - set(SOURCE_KEYS))
    if unknown:
        raise UserError(f"config key 'sources': the entry for {name!r} has unknown key(s) {', '.join(unknown)}; "
                        f"valid keys: {', '.join(SOURCE_KEYS)}")
    if name in EVAL_SETS:
        raise UserError(f"config key 'sources': {name!r} is an evaluation set (the benchmarks' own prompts), and "
                        f"training on it would leak the evaluation; {valid}")
    if name not in TRAINING_SETS and not name.endswith((".json", ".jsonl")):
        raise UserError(f"config key 'sources': unknown source {name!r}; {valid}")
    n = s.get("n", -1)
    if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
        raise UserError(f"config key 'sources': n of {name!r} must be a positive number of prompts or -1 (all), "
                        f"got {n!r}")
    fld = s.get("field") or ""
    if not isinstance(fld, str):
        raise UserError(f"config key 'sources': field of {name!r} must be a field name, got {fld!r}")
    return {"name": name, "n": n, "field": fld}


def config_hash(cfg: DatagenConfig) -> str:
    d = {k: v for k, v in cfg.stored().items() if k not in UNHASHED_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
