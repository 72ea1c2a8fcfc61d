"""Data generation for acceptance heads: targets, mixing, features, prompt mixes, storage, resume, errors.

Every stored quantity is recomputed here independently, by teacher-forced unbatched forwards of
the tiny models over prompt + X (for P_i, 1 - TV and the draft's statistics) and prompt + Z (for
the features).
"""
from __future__ import annotations

import io
import json
import random
import shutil

import pytest
import torch

from adaptive_spec import cli, prompt_archives, prompts

from adaptive_spec.datagen import batched, shards
from adaptive_spec.datagen import generate as datagen

from adaptive_spec.training.data import load_split, read_manifest
from adaptive_spec.training.settings import TrainConfig
from adaptive_spec.config import load_config
from adaptive_spec.datagen.config import DatagenConfig, config_hash
from adaptive_spec.params import PairParams
from adaptive_spec.prompts import encode_prompt
from adaptive_spec.runs import PROJECT_ROOT, tensors_meta
from adaptive_spec.decoding.sampling import SamplingParams, process_logits
from adaptive_spec.tables import fmt
from adaptive_spec.training.metrics import auc

TOP_K, TOP_P = 20, 0.95  # non-trivial processing (vocab 32), so p and q must be the processed ones


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models on a shared 2-core machine: a second thread only adds synchronisation stalls
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write_prompts(path, n=24, seed=0, field="question"):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(2, 6))]
            f.write(json.dumps({field: " ".join(words), "other": 1}) + "\n")
    return path


def _overrides(tiny_pair, prompts, out_dir, **extra):
    draft, target = tiny_pair
    kw = dict(dataset=str(prompts), prompt_field="question", draft=str(draft), target=str(target), dtype="fp32",
              device="cpu", max_new_tokens=14, batch_size=3, shard_size=5, top_k=TOP_K, top_p=TOP_P,
              train_frac=0.6, dev_frac=0.2, test_frac=0.2, seed=7, out_dir=str(out_dir), progress=False, name="t",
              threads=1)  # tiny models: one thread avoids oversubscription stalls on a busy machine
    kw.update(extra)
    return [f"pair.{k}={v}" if k in PairParams.model_fields else f"{k}={v}" for k, v in kw.items()]


def _run(overrides) -> dict:
    return datagen.run(load_config(DatagenConfig, None, overrides))


@pytest.fixture(scope="module")
def ref_run(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("datagen")
    prompts = _write_prompts(root / "prompts.jsonl")
    out = root / "ref"
    man = _run(_overrides(tiny_pair, prompts, out))
    return prompts, out, man


def _models(tiny_pair):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in tiny_pair]


def _all_seqs(out):
    for split in datagen.SPLITS:
        for sh in shards.iter_shards(out, split):
            io_, ro = sh["input_offsets"], sh["resp_offsets"]
            for i in range(len(sh["prompt_lens"])):
                pl = int(sh["prompt_lens"][i])
                ids = sh["input_ids"][io_[i]:io_[i + 1]].long()
                r = slice(int(ro[i]), int(ro[i + 1]))
                yield {"prompt": ids[:pl], "z_in": ids[pl:], "split": split, "source": int(sh["source_ids"][i]),
                       **{k: sh[k][r] for k in ("x_ids", "y_ids", "z_ids", "loss_mask", "accept_prob",
                                                "expected_accept", "draft_stats", "features")}}


def test_manifest_and_shard_format(ref_run, tiny_pair):
    prompts, out, man = ref_run
    disk = json.loads((out / "manifest.json").read_text())
    assert disk == json.loads(json.dumps(man))
    assert man["format"] == "adaptive_spec.datagen.v1" and man["complete"] and man["seed"] == 7
    assert man["config"]["mix_ratio"] == 0.15 and len(man["config_hash"]) == 16
    assert man["models"]["draft"]["hidden_size"] == 16 and man["models"]["target"]["hidden_size"] == 24
    assert man["models"]["draft"]["vocab_size"] == 32
    assert man["models"]["draft"]["fingerprint"] != man["models"]["target"]["fingerprint"]
    total = 0
    for split in datagen.SPLITS:
        s = man["splits"][split]
        total += s["n_prompts"]
        assert s["n_prompts"] == sum(sh["n_seqs"] for sh in s["shards"])
        assert s["n_tokens"] == sum(sh["n_tokens"] for sh in s["shards"])
        for sh_entry, sh in zip(s["shards"], shards.iter_shards(out, split)):
            assert sh_entry["file"].startswith(f"{split}/shard-")
            T, n = sh["z_ids"].numel(), sh["prompt_lens"].numel()
            assert (T, n) == (sh_entry["n_tokens"], sh_entry["n_seqs"])
            assert int(sh["loss_mask"].sum()) == sh_entry["n_loss_tokens"]
            dtypes = {"input_ids": torch.int32, "input_offsets": torch.int64, "prompt_lens": torch.int32,
                      "resp_offsets": torch.int64, "x_ids": torch.int32, "y_ids": torch.int32, "z_ids": torch.int32,
                      "loss_mask": torch.uint8, "accept_prob": torch.float32, "expected_accept": torch.float32,
                      "features": torch.bfloat16, "draft_stats": torch.float32, "source_ids": torch.int32}
            assert {k: v.dtype for k, v in sh.items()} == dtypes
            assert sh["features"].shape == (T, 16) and sh["draft_stats"].shape == (T, 3)
            assert sh["source_ids"].shape == (n,) and not sh["source_ids"].any()  # one source: index 0
            assert sh["input_ids"].numel() == int(sh["input_offsets"][-1]) == int(sh["prompt_lens"].sum()) + T
            assert sh["resp_offsets"].shape == (n + 1,) and int(sh["resp_offsets"][-1]) == T
    assert total == 24  # every (distinct) prompt lands in exactly one split
    (src,) = man["sources"]  # `dataset` is a one-source mix taking all
    assert (src["name"], src["n"], src["field"]) == (str(prompts), -1, "question")
    assert src["splits"] == {s: {k: man["splits"][s][k] for k in shards.COUNTS} for s in datagen.SPLITS}


def test_targets_and_features_match_teacher_forced_recompute(ref_run, tiny_pair):
    _, out, _ = ref_run
    draft, target = _models(tiny_pair)
    params = SamplingParams(1.0, TOP_K, TOP_P)
    n_seq = 0
    for s in _all_seqs(out):
        n_seq += 1
        pl, N = len(s["prompt"]), len(s["x_ids"])
        assert 1 <= N <= 14 and torch.equal(s["z_in"], s["z_ids"].long())
        tf = torch.cat([s["prompt"], s["x_ids"].long()])[None]
        with torch.no_grad():
            p = process_logits(target(tf).logits[0, pl - 1:pl - 1 + N], params)
            q = process_logits(draft(tf).logits[0, pl - 1:pl - 1 + N], params)
            h = draft.model(torch.cat([s["prompt"], s["z_ids"].long()])[None]).last_hidden_state[0, pl:pl + N]
        rows, y = torch.arange(N), s["y_ids"].long()
        assert (q[rows, y] > 0).all()  # Y_i was drawn from the processed q_i
        torch.testing.assert_close(s["accept_prob"], (p[rows, y] / q[rows, y]).clamp(max=1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s["expected_accept"], 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-5, rtol=1e-4)
        assert (p[rows, s["x_ids"].long()] > 0).all()  # X_i was drawn from the processed p_i
        torch.testing.assert_close(s["features"].float(), h, atol=2e-2, rtol=1e-2)  # bf16 storage
        # the draft's statistics of its candidate Y_i under the processed q_i (the decoder's q)
        top2 = q.topk(2, dim=-1).values
        direct = torch.stack([q[rows, y].log(), -torch.special.xlogy(q, q).sum(-1), top2[:, 0] - top2[:, 1]], -1)
        torch.testing.assert_close(s["draft_stats"], direct, atol=1e-4, rtol=1e-4)
        if N < 14:  # a response shorter than max_new_tokens ended with EOS (id 1), and only there
            assert int(s["x_ids"][-1]) == 1 and not (s["x_ids"][:-1] == 1).any()
    assert n_seq == 24


def test_mixing_follows_loss_mask(ref_run):
    _, out, _ = ref_run
    n = n_x = 0
    for s in _all_seqs(out):
        m = s["loss_mask"].bool()
        assert torch.equal(s["z_ids"][m], s["y_ids"][m]) and torch.equal(s["z_ids"][~m], s["x_ids"][~m])
        n += len(m)
        n_x += int((~m).sum())
    assert n > 150 and abs(n_x / n - 0.15) < 0.1  # r = 0.15 with ~200 tokens: sd ~0.025


def test_mix_share_is_r():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.zeros(200_000, dtype=torch.long), torch.ones(200_000, dtype=torch.long)
    for r in (0.0, 0.15, 0.5, 1.0):
        z, mask = batched.mix_tokens(x, y, r, gen)
        assert abs(float((z == 0).float().mean()) - r) < 0.005
        assert torch.equal(mask.bool(), z == 1)


def test_kill_and_resume_is_byte_identical(ref_run, tiny_pair, tmp_path, monkeypatch):
    prompts, ref, ref_man = ref_run
    out = tmp_path / "resumed"
    real_write, calls = shards.save_tensors, []

    def dying_write(path, tensors, key, meta):
        calls.append(path)
        if len(calls) == 2:  # the process "dies" while computing the second shard
            raise KeyboardInterrupt
        real_write(path, tensors, key, meta)

    monkeypatch.setattr(shards, "save_tensors", dying_write)
    with pytest.raises(KeyboardInterrupt):
        _run(_overrides(tiny_pair, prompts, out))
    man = json.loads((out / "manifest.json").read_text())
    done = [sh["file"] for split in man["splits"].values() for sh in split["shards"]]
    assert not man["complete"] and done == ["dev/shard-00000.safetensors"]  # dev is generated first
    monkeypatch.setattr(shards, "save_tensors", real_write)
    (out / "train" / ".shard-00001.safetensors.tmp.999").write_bytes(b"half-written")  # left by a real kill
    assert datagen.main(["--config", str(_yaml(tmp_path, _overrides(tiny_pair, prompts, out)))]) == 0

    ref_files = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
    assert ref_files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())  # no tmp files left
    for f in ref_files:
        if f.suffix == ".safetensors":
            assert (ref / f).read_bytes() == (out / f).read_bytes(), f
    man = json.loads((out / "manifest.json").read_text())
    assert man["complete"] and man["config"].pop("out_dir") == str(out)
    ref_disk = json.loads((ref / "manifest.json").read_text())
    ref_disk["config"].pop("out_dir")
    assert man == ref_disk


@pytest.mark.slow
def test_two_processes_write_the_same_dataset(ref_run, tiny_pair, tmp_path):
    """`accelerate launch --num_processes 2` (CPU, gloo): shard k goes to process k % 2, and the
    result is byte-identical to the one-process run, manifest included."""
    import os
    import subprocess
    import sys

    prompts, ref, _ = ref_run
    out = tmp_path / "two"
    cfg = _yaml(tmp_path, _overrides(tiny_pair, prompts, out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "-m", "adaptive_spec.datagen.generate", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ref_files = sorted(p.relative_to(ref) for p in ref.rglob("*.safetensors"))
    assert ref_files == sorted(p.relative_to(out) for p in out.rglob("*.safetensors"))
    for f in ref_files:
        assert (ref / f).read_bytes() == (out / f).read_bytes(), f
    man, ref_man = (json.loads((d / "manifest.json").read_text()) for d in (out, ref))
    for m in (man, ref_man):
        m["config"].pop("out_dir")
    assert man["complete"] and man == ref_man


def _yaml(tmp_path, overrides):
    path = tmp_path / "cfg.yaml"
    path.write_text("".join(f"{o.split('=', 1)[0]}: {json.dumps(o.split('=', 1)[1])}\n" for o in overrides))
    return path


def test_unknown_config_key_lists_valid_keys(capsys):
    assert datagen.main(["dataset=x.jsonl", "mix_rate=0.2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "'mix_rate'" in err and "mix_ratio" in err and "\n" not in err


def test_missing_prompt_field_lists_fields(tiny_pair, tmp_path, capsys):
    prompts = _write_prompts(tmp_path / "p.jsonl", n=4)
    ov = _overrides(tiny_pair, prompts, tmp_path / "out", prompt_field="instruction")
    assert datagen.main(ov) == 2
    err = capsys.readouterr().err
    assert "'instruction'" in err and "question, other" in err


def test_out_dir_with_another_config_is_refused(ref_run, tiny_pair, tmp_path, capsys):
    prompts, ref, _ = ref_run
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert datagen.main(_overrides(tiny_pair, prompts, out, seed=8)) == 2
    err = capsys.readouterr().err
    assert "seed" in err and "overwrite=true" in err and "same config" in err
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}  # untouched
    # overwrite=true starts over with the new config
    man = _run(_overrides(tiny_pair, prompts, out, seed=8, overwrite="true", max_train_prompts=2,
                          max_dev_prompts=0, max_test_prompts=0, store_features="false"))
    assert man["complete"] and man["splits"]["train"]["n_prompts"] == 2 and man["splits"]["dev"]["shards"] == []
    assert not (out / "dev" / "shard-00000.safetensors").exists()
    assert "features" not in shards.load_shard(out / "train" / "shard-00000.safetensors")


def test_split_by_prompt_hash_is_stable():
    texts = [f"prompt number {i}" for i in range(5000)]
    a = [datagen.split_of(t, 0.7, 0.2) for t in texts]
    assert a == [datagen.split_of(t, 0.7, 0.2) for t in texts]
    for s, frac in (("train", 0.7), ("dev", 0.2), ("test", 0.1)):
        assert abs(a.count(s) / len(a) - frac) < 0.03


def test_chat_template_is_applied(tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    ids = encode_prompt(tok, "ab c", chat=True)
    assert ids[0] == 3 and tok.decode(ids[1:]) == "ab c"  # <|user|> from the template
    assert encode_prompt(tok, "ab c", chat=False) == ids[1:]


def test_json_array_parser_stops_at_truncated_tail():
    text = '[{"id": 1, "conversations": [{"from": "human", "value": "hi"}]},\n {"id": 2}, {"id": 3, "conv'
    got = list(prompt_archives._iter_json_array(io.BytesIO(text.encode()), chunk_chars=7))
    assert [o["id"] for o in got] == [1, 2]
    assert [o["id"] for o in prompt_archives._iter_json_array(io.BytesIO(b'[{"id": 1}, {"id": 2}]'))] == [1, 2]


@pytest.mark.parametrize("name", ["gsm8k", "alpaca", "sharegpt", "mix"])
def test_shipped_configs_load(name):
    path = PROJECT_ROOT / "configs" / "datagen" / f"{name}.yaml"
    assert "dataset: ../" not in path.read_text()  # named sets: ADAPTIVE_SPEC_DATA reaches datagen too
    cfg = load_config(DatagenConfig, path)
    assert cfg.pair.draft == cfg.pair.target == "default" and cfg.mix_ratio == 0.15 and cfg.top_k == 50
    if name == "mix":  # the real mixed-set run
        assert [s["name"] for s in cfg.sources] == ["sharegpt", "gsm8k-train", "sharegpt-code", "mbpp"]
        assert cfg.max_new_tokens >= 128 and cfg.dev_frac > 0
        # the token data is committed (data/datagen/mix) and features are derived from it: datagen_features
        assert not cfg.store_features and cfg.out_dir == "data/datagen/mix"
        assert (cfg.pair.draft_quant, cfg.pair.draft_vocab) == ("int8", None)  # the draft the project serves
        n_train = sum(s["n"] if s["n"] > 0 else 397 for s in cfg.sources) * cfg.train_frac
        # 300k loss positions within reach at a mean response of 82 tokens (the config's arithmetic)
        assert n_train * 82 * (1 - cfg.mix_ratio) >= 300_000
        return
    assert cfg.dataset in prompts.BUILTIN
    if cfg.dataset != "sharegpt" and prompts.shared_data_dir().is_dir():  # the offline copy is there
        texts = datagen.load_prompt_texts(cfg)
        assert len(texts) in (7473, 805) and all(isinstance(t, str) for t in texts[:10])


def test_datagen_reads_named_sets_like_sweeps(tmp_path, monkeypatch):
    """One loader for both: a named set comes from ADAPTIVE_SPEC_DATA, in file order (datagen
    splits by hash), and sweeps see the same texts shuffled."""
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text("".join(json.dumps({"question": f"q{i}?"}) + "\n" for i in range(6)))
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA", str(tmp_path))
    cfg = load_config(DatagenConfig, None, ["dataset=gsm8k-train"])
    texts = datagen.load_prompt_texts(cfg)
    assert texts == [f"q{i}?" for i in range(6)]
    assert sorted(prompts.load_prompts("gsm8k-train")) == texts


# ------------------------------------------------------------------------------ prompt mixes


def _words(rng, letters):
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(2, 5)))


@pytest.fixture
def mix_sets(tmp_path, monkeypatch):
    """Offline stand-ins of the named training sets: gsm8k/train.jsonl under ADAPTIVE_SPEC_DATA and
    the ShareGPT and MBPP caches under ADAPTIVE_SPEC_DATA_CACHE (texts in the tiny tokenizer's alphabet)."""
    rng = random.Random(3)
    # letters only: the tiny tokenizer knows a-z, space and 0 (other digits would all be <unk>)
    texts = {"gsm8k-train": [f"how many {_words(rng, 'abcdef')}" for _ in range(20)],
             "sharegpt": [f"tell me {_words(rng, 'ghijkl')}" for _ in range(16)]
             + [f"python write a function {_words(rng, 'mnopq')}" for _ in range(14)],
             "mbpp": [f"def {_words(rng, 'rstuv')}" for _ in range(7)]}
    files = {"gsm8k-train": ("data/gsm8k/train.jsonl", "question"), "sharegpt": (
        "cache/sharegpt/sharegpt_first_exchanges.jsonl", "prompt"), "mbpp": ("cache/mbpp/mbpp.jsonl", "prompt")}
    for name, (rel, fld) in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("".join(json.dumps({fld: t}) + "\n" for t in texts[name]))
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_CACHE", str(tmp_path / "cache"))
    texts["sharegpt-code"] = [t for t in texts["sharegpt"] if prompt_archives.is_code_prompt(t)]
    assert len(texts["sharegpt-code"]) == 14
    return texts


MIX = "[{name: sharegpt, n: 8}, {name: gsm8k-train, n: 9}, {name: sharegpt-code, n: 5}, {name: mbpp}]"


def test_mix_draws_counts_per_source_with_own_dev_splits(tiny_pair, mix_sets, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "mix"
    man = _run(_overrides(tiny_pair, "", out, dataset="", prompt_field="", sources=MIX, max_new_tokens=5,
                          train_frac=0.5, dev_frac=0.3, test_frac=0.2))
    names = ["sharegpt", "gsm8k-train", "sharegpt-code", "mbpp"]
    assert [(s["name"], s["n"], s["field"]) for s in man["sources"]] == list(zip(names, [8, 9, 5, -1], [""] * 4))
    drawn = {s["name"]: sum(s["splits"][sp]["n_prompts"] for sp in datagen.SPLITS) for s in man["sources"]}
    assert drawn == {"sharegpt": 8, "gsm8k-train": 9, "sharegpt-code": 5, "mbpp": 7}  # mbpp: n absent = all
    assert all(s["splits"]["dev"]["n_prompts"] > 0 for s in man["sources"])  # a dev split per source

    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    text_of = {tuple(encode_prompt(tok, t, True)): t for ts in mix_sets.values() for t in ts}
    seqs = list(_all_seqs(out))
    seen = [text_of[tuple(q["prompt"].tolist())] for q in seqs]
    assert len(set(seen)) == len(seen) == 29  # no text twice, though sharegpt and sharegpt-code overlap
    counted = {(n, sp): dict.fromkeys(shards.COUNTS, 0) for n in names for sp in datagen.SPLITS}
    for q, text in zip(seqs, seen):
        name = names[q["source"]]
        assert text in mix_sets[name] and q["split"] == datagen.split_of(text, 0.5, 0.3)
        c = counted[name, q["split"]]
        c["n_prompts"], c["n_tokens"] = c["n_prompts"] + 1, c["n_tokens"] + len(q["z_ids"])
        c["n_loss_tokens"] += int(q["loss_mask"].sum())
    # source_ids and the manifest's per-source counts agree: per-source dev metrics need nothing else
    assert counted == {(s["name"], sp): s["splits"][sp] for s in man["sources"] for sp in datagen.SPLITS}


@pytest.mark.parametrize("sources, expect", [
    ("[{name: nope, n: 5}]", ["unknown source 'nope'", "'sources'", *prompts.TRAINING_SETS, ".jsonl"]),
    ("[{name: humaneval}]", ["'humaneval' is an evaluation set", "'sources'", "mbpp"]),
    ("[{name: mbpp, count: 5}]", ["unknown key(s) count", "name, n, field"]),
    ("[{name: mbpp, n: 0}]", ["n of 'mbpp'", "-1 (all)"]),
    ("[mbpp, mbpp]", ["'mbpp' twice"]),
])
def test_bad_mix_is_one_error_line(tiny_pair, tmp_path, capsys, sources, expect):
    assert datagen.main(_overrides(tiny_pair, "", tmp_path / "out", dataset="", sources=sources)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    for e in expect:
        assert e in err, (e, err)
    assert not (tmp_path / "out").exists()


def test_dataset_and_sources_together_are_refused(tiny_pair, tmp_path, capsys):
    assert datagen.main(_overrides(tiny_pair, "p.jsonl", tmp_path / "out", sources="[mbpp]")) == 2
    assert "'dataset' and 'sources' are both set" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["draft_quant", "draft_vocab", "draft"])
def test_resume_with_another_draft_configuration_is_refused(ref_run, tiny_pair, tmp_path, capsys, monkeypatch, key):
    prompts_file, ref, _ = ref_run
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    old = json.loads((ref / "manifest.json").read_text())["config"][key]
    new = {"draft_quant": "int8", "draft_vocab": "16", "draft": str(tiny_pair[1])}[key]

    def no_load(*a, **k):
        raise AssertionError("the draft configuration is checked before the models load")

    monkeypatch.setattr(datagen, "load_models", no_load)
    assert datagen.main(_overrides(tiny_pair, prompts_file, out, **{key: new})) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert f"another draft configuration ({key}: {old!r} there, {new!r} now)" in err
    assert "another out_dir" in err and "overwrite=true" in err
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}  # untouched


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_features_derived_later_equal_stored_ones(ref_run, tiny_pair, tmp_path, quant, capsys):
    """A run stored without features, completed by datagen-features, equals the same run stored
    with them: token data bit for bit, features up to bf16 rounding (the uncached pass over
    (prompt, Z) against datagen's pass over Z on the prompt's cache), for the int8 draft too."""
    from adaptive_spec.datagen import features as datagen_features

    prompts, ref, _ = ref_run
    kw = dict(draft_quant=quant, max_train_prompts=4)
    ref = tmp_path / "with"
    _run(_overrides(tiny_pair, prompts, ref, **kw))
    bare, out = tmp_path / "bare", tmp_path / "derived"
    man_bare = _run(_overrides(tiny_pair, prompts, bare, store_features="false", **kw))
    man = datagen_features.run(str(bare), str(out), dtype="fp32", device="cpu", progress=False)
    assert man["complete"] and man["config_hash"] == man_bare["config_hash"]
    assert man["splits"] == man_bare["splits"] and man["features"]["from"] == str(bare)
    for sh in (e["file"] for s in man["splits"].values() for e in s["shards"]):
        assert tensors_meta(out / sh, shards.META_KEY) == tensors_meta(bare / sh, shards.META_KEY)  # the source's, kept
    n = 0
    for split in datagen.SPLITS:
        for a, b in zip(shards.iter_shards(ref, split), shards.iter_shards(out, split), strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if k != "features":
                    assert torch.equal(a[k], b[k]), k
            assert a["features"].shape == b["features"].shape
            fa, fb = a["features"].float(), b["features"].float()
            # within two bf16 ulps: int8 weights ignored would move them ~0.02 at |h| ~ 0.8 (5 ulps)
            assert ((fa - fb).abs() <= fa.abs() * 2**-6 + 1e-5).all()
            n += len(a["features"])
    assert n > 0
    # a rerun has nothing to do; another run's folder is refused, naming both hashes
    datagen_features.run(str(bare), str(out), dtype="fp32", device="cpu", progress=False)
    assert "up to date" in capsys.readouterr().err
    assert cli.main(["datagen-features", "--data", str(ref_run[1]), "--out", str(out), "--dtype", "fp32"]) == 2
    assert "another datagen run" in capsys.readouterr().err


def test_target_prefix_states_are_the_decoders_inputs(ref_run, tiny_pair, tmp_path, capsys):
    """datagen-features --prefix target: features[i] is the draft's state after (x, X_<i, Y_i) and
    context_features[i] the state after (x, X_<i), each equal to a plain forward over that prefix,
    and the context state is the one datagen's q_i came from (its q gives datagen's log q(Y_i));
    training then uses every position. A folder of the other prefix is refused."""
    from adaptive_spec.datagen import features as datagen_features

    prompts, _, _ = ref_run
    bare, out = tmp_path / "bare", tmp_path / "target"
    _run(_overrides(tiny_pair, prompts, bare, store_features="false", max_train_prompts=4))
    man = datagen_features.run(str(bare), str(out), dtype="fp32", device="cpu", progress=False, prefix="target")
    assert man["features"]["prefix"] == "target" and man["complete"]
    draft, _ = _models(tiny_pair)
    params = SamplingParams(1.0, TOP_K, TOP_P)
    n = 0
    for split in datagen.SPLITS:
        for sh in shards.iter_shards(out, split):
            io_, ro, pls = sh["input_offsets"], sh["resp_offsets"], sh["prompt_lens"]
            for s in range(len(pls)):
                prompt = sh["input_ids"][int(io_[s]):int(io_[s]) + int(pls[s])].long()
                a, b = int(ro[s]), int(ro[s + 1])
                X, Y = sh["x_ids"][a:b].long(), sh["y_ids"][a:b].long()
                for i in range(b - a):
                    with torch.no_grad():
                        h_tok = draft.model(torch.cat([prompt, X[:i], Y[i:i + 1]])[None]).last_hidden_state[0, -1]
                        h_ctx = draft.model(torch.cat([prompt, X[:i]])[None]).last_hidden_state[0, -1]
                        log_q = process_logits(draft.lm_head(h_ctx)[None], params)[0, Y[i]].log()
                    torch.testing.assert_close(sh["features"][a + i].float(), h_tok, atol=2e-2, rtol=1e-2)
                    torch.testing.assert_close(sh["context_features"][a + i].float(), h_ctx, atol=2e-2, rtol=1e-2)
                    torch.testing.assert_close(log_q, sh["draft_stats"][a + i, 0], atol=1e-4, rtol=1e-4)
                    n += 1
    assert n > 20
    cfg = TrainConfig(data=str(out), feature="context")
    assert len(load_split(cfg, read_manifest(out), "train", None)) == man["splits"]["train"]["n_tokens"]
    assert cli.main(["datagen-features", "--data", str(bare), "--out", str(out), "--dtype", "fp32"]) == 2
    assert "holds states on the target prefix, and --prefix is mixed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["datagen-features", "--data", str(bare), "--out", str(out), "--prefix", "x"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_features_resume_after_a_lost_shard_and_refuse_another_draft(ref_run, tiny_pair, tmp_path, capsys):
    from adaptive_spec.datagen import features as datagen_features

    prompts, _, _ = ref_run
    bare, out = tmp_path / "bare", tmp_path / "derived"
    _run(_overrides(tiny_pair, prompts, bare, store_features="false", max_train_prompts=4))
    datagen_features.run(str(bare), str(out), dtype="fp32", device="cpu", progress=False)
    f = out / "dev" / "shard-00000.safetensors"
    before = shards.load_shard(f)
    f.unlink()  # as a kill before its atomic write would leave it
    man = datagen_features.run(str(bare), str(out), dtype="fp32", device="cpu", progress=False)
    assert man["complete"] and torch.equal(shards.load_shard(f)["features"], before["features"])
    # the data names a draft whose weights are not the ones that generated it
    m = json.loads((bare / "manifest.json").read_text())
    m["models"]["draft"]["fingerprint"] = "0" * 16
    (bare / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(out)
    assert cli.main(["datagen-features", "--data", str(bare), "--out", str(out), "--dtype", "fp32", "--no-progress"]) == 2
    assert "fingerprint" in capsys.readouterr().err


def test_datagen_stats_adds_up_to_the_manifest(ref_run, tmp_path, capsys):
    """eval/datagen_stats.py: per-source rows sum to each split's manifest counts, and the
    acceptance means are those of the loss positions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("datagen_stats", PROJECT_ROOT / "eval" / "datagen_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _, out, man = ref_run
    _, rows = mod.stats(out)
    col = {h: i for i, h in enumerate(mod.HEADER)}
    for split in datagen.SPLITS:
        total = [r for r in rows if r[0] == split and r[1] == "**all**"]
        if not man["splits"][split]["n_prompts"]:
            assert not total
            continue
        (total,) = total
        for key, name in (("n_prompts", "responses"), ("n_tokens", "tokens"), ("n_loss_tokens", "loss positions")):
            assert int(total[col[name]]) == man["splits"][split][key]
        P = torch.cat([sh["accept_prob"][sh["loss_mask"].bool()] for sh in shards.iter_shards(out, split)])
        assert total[col["mean P"]] == f"{P.double().mean():.3f}"
        logq = torch.cat([sh["draft_stats"][sh["loss_mask"].bool(), 0] for sh in shards.iter_shards(out, split)])
        assert total[col["AUC log q(Y)"]] == fmt(auc(logq, P), ".3f")
    assert mod.main(["--data", str(out), "--goal", "1000", "--out", str(tmp_path / "new" / "s.md")]) == 0
    text = (tmp_path / "new" / "s.md").read_text()
    have, every = man["splits"]["train"]["n_loss_tokens"], man["splits"]["train"]["n_tokens"]
    assert f"{have} of the goal 1000" in text and f"; {every} ({every / 1000:.1%}) with states on the target prefix" in text


def test_the_committed_token_data_still_reads():
    """data/datagen/mix was written by an earlier version: its manifest format and its shards'
    metadata key are a file format, kept when modules move."""
    from adaptive_spec.datagen.shards import load_shard

    root = PROJECT_ROOT / "data" / "datagen" / "mix"
    man = read_manifest(root, partial=True)
    first = root / man["splits"]["dev"]["shards"][0]["file"]
    shard = load_shard(first)
    assert man["format"] == "adaptive_spec.datagen.v1" and len(shard["input_ids"]) > 0
    # its flat config reads into the pair and back unchanged, and so does the YAML that made it: a
    # rerun resumes it, and features and heads keyed by its hash still match
    cfg = DatagenConfig.from_stored(man["config"])
    assert cfg.stored() == man["config"] and config_hash(cfg) == man["config_hash"]
    assert cfg.pair.draft_quant == "int8" and cfg.pair.draft_vocab is None and cfg.pair.threads == 2
    shipped = load_config(DatagenConfig, PROJECT_ROOT / "configs" / "datagen" / "mix.yaml")
    assert config_hash(shipped) == man["config_hash"]
