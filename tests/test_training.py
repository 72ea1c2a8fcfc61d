import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from adaptive_spec.training import loop, metrics, runfiles, train
from adaptive_spec.training.data import load_split, read_manifest
from adaptive_spec.training.runfiles import RunFiles
from adaptive_spec.training.settings import TrainConfig
from adaptive_spec.runs import read_jsonl
from adaptive_spec.cli import main as cli_main
from adaptive_spec.config import load_config
from adaptive_spec.errors import UserError
from adaptive_spec.heads.head import AcceptanceHead, shard_inputs, shard_positions
from train_fixtures import make_dataset

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# One thread per process: tiny matmuls only get slower with more, and the machine is shared.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
       "TOKENIZERS_PARALLELISM": "false"}
RUN = ["report_to=none", "epochs=2", "batch_size=32", "lr=1e-2", "w_rej=1", "depth=2", "warmup_ratio=0.1",
       "log_every=2", "eval_every=10", "save_every=4"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data") / "ds", seqs={"train": 40, "dev": 12, "test": 4})


def launch(args, accelerate=True, timeout=120, processes=1):
    cmd = ([str(BIN / "accelerate"), "launch", "--cpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"] if accelerate else [sys.executable])
    return subprocess.run(cmd + ["train.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- loss and metrics by hand

def test_weighted_bce_matches_hand_computation():
    logits = torch.tensor([0.0, 2.0, -1.0, 3.0])
    target = torch.tensor([1.0, 0.5, 0.2, 0.0])
    w_rej = 3.0
    want = 0.0
    for z, p in zip(logits.tolist(), target.tolist()):
        q = 1 / (1 + math.exp(-z))
        want += -(1.0 * p * math.log(q) + w_rej * (1 - p) * math.log(1 - q))
    got = metrics.weighted_bce(logits, target, w_acc=1.0, w_rej=w_rej)
    assert got.item() == pytest.approx(want / 4, rel=1e-6)
    # Stable at extreme logits where sigmoid rounds to 1 in float32.
    assert torch.isfinite(metrics.weighted_bce(torch.tensor([40.0]), torch.tensor([0.0]))).all()


def test_binary_kl_and_ece_by_hand():
    target = torch.tensor([1.0, 0.0, 0.3, 0.3])
    logits = torch.tensor([0.0, 0.0, 0.0, math.log(0.3 / 0.7)])
    kl = metrics.binary_kl(target, logits)
    want = [math.log(2), math.log(2), 0.3 * math.log(0.3 / 0.5) + 0.7 * math.log(0.7 / 0.5), 0.0]
    torch.testing.assert_close(kl, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    pred = torch.tensor([0.05, 0.15, 0.95, 0.92])
    tgt = torch.tensor([0.05, 0.35, 0.75, 0.82])
    bins = metrics.calibration_bins(pred, tgt, 10)
    assert bins[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    # bin 0: |0.05-0.05|, bin 1: |0.15-0.35|, bin 9: |0.935-0.785| x 2 positions
    assert metrics.ece(bins) == pytest.approx((0 + 0.2 + 2 * 0.15) / 4)


def test_lr_schedule_warms_up_then_decays():
    f = runfiles.lr_lambda(total=100, warmup=10, min_ratio=0.0)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_config_refuses_unknown_keys_and_bad_values(tmp_path):
    with pytest.raises(UserError, match="valid keys: data, output_dir"):
        load_config(TrainConfig, None, ["data=x", "wrej=3"])
    with pytest.raises(UserError, match="key .target. must be one of accept_prob, expected_accept, got .foo."):
        load_config(TrainConfig, None, ["data=x", "target=foo"])
    with pytest.raises(UserError, match="missing required key"):
        load_config(TrainConfig, None, [])
    for f in sorted((ROOT / "configs" / "train").glob("*.yaml")):  # the shipped heads' configs load
        if not f.name.startswith("drafter_"):  # the feature drafter's: tests/test_configs.py
            load_config(TrainConfig, f, ["data=x"])


def test_bad_datasets_are_refused(tmp_path, dataset):
    with pytest.raises(UserError, match="manifest.json does not exist; point data= at a folder written by datagen"):
        read_manifest(tmp_path)
    m = json.loads((dataset / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(UserError, match="incomplete"):
        read_manifest(tmp_path)
    cfg = TrainConfig(data=str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="is missing"):  # manifest names shards that are not there
        load_split(cfg, m, "train", None)


# ---------------------------------------------------------------- data

def test_auc_by_hand_and_against_all_pairs():
    # accepted (P >= 0.99, 0.995 included) at scores 0.3 and 0.8; rejected at 0.1, 0.35 and 0.8 (a tie)
    score = torch.tensor([0.1, 0.3, 0.35, 0.8, 0.8])
    target = torch.tensor([0.0, 0.995, 0.5, 1.0, 0.2])
    assert metrics.auc(score, target) == pytest.approx((1 + 2.5) / 6)
    assert math.isnan(metrics.auc(score, torch.ones(5)))  # one class only
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 6, (300,), generator=g).double()  # many ties
    t = (torch.rand(300, generator=g) < 0.7).double()
    pos, neg = s[t >= 0.99], s[t < 0.99]
    pairs = (pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()
    assert metrics.auc(s, t) == pytest.approx(pairs.mean().item(), abs=1e-12)


def test_ece_and_metrics_on_hand_made_predictions():
    pred = torch.tensor([0.02, 0.5, 0.51, 0.99], dtype=torch.float64)
    tgt = torch.tensor([0.0, 1.0, 0.0, 1.0])
    m, bins = metrics.prediction_metrics(torch.logit(pred), tgt, n_bins=15)
    # 15 bins of width 1/15: 0.02 -> bin 0, 0.5 and 0.51 -> bin 7, 0.99 -> bin 14
    assert bins[0].nonzero().flatten().tolist() == [0, 7, 14]
    assert m["ece"] == pytest.approx((0.02 + 2 * abs(0.505 - 0.5) + 0.01) / 4, abs=1e-12)
    assert m["auc"] == 0.75 and m["n"] == 4 and m["mean_pred"] == pytest.approx(0.505)  # 0.5 (accepted) < 0.51
    assert m["kl"] == pytest.approx(metrics.binary_kl(tgt, torch.logit(pred)).mean().item())
    # the constant at the mean target: calibrated (ECE 0) and blind (AUC 0.5)
    const = torch.zeros(4, dtype=torch.float64)  # logit 0: p_hat = 0.5, the mean target
    m, _ = metrics.prediction_metrics(const, tgt, n_bins=10)
    assert m["ece"] == pytest.approx(0.0, abs=1e-12) and m["auc"] == 0.5


@pytest.mark.parametrize("clean", [False, True], ids=["mixed-prefix", "target-prefix"])
@pytest.mark.parametrize("feature,inputs", [("token", "hidden"), ("token", "hidden+stats"), ("context", "hidden"),
                                            ("context", "hidden+stats"), ("context", "stats")])
def test_training_rows_are_shard_inputs_rows(dataset, tmp_path, feature, inputs, clean):
    """What training feeds the head at each position is what heads.shard_inputs (the offline
    replay) builds for it, row for row, and the stats are datagen's draft_stats there. On
    target-prefix states every position is used, a context head reading context_features."""
    if clean:
        dataset = make_dataset(tmp_path / "clean", seqs={"train": 12, "dev": 4}, clean=True)
    cfg = TrainConfig(data=str(dataset), feature=feature, inputs=inputs)
    m = read_manifest(dataset)
    ds = load_split(cfg, m, "train", None)
    x, y = ds.gather(torch.arange(len(ds)))
    head = AcceptanceHead(16, depth=0, feature=feature, inputs=inputs)
    want_x, want_y = [], []
    for s in m["splits"]["train"]["shards"]:
        shard = load_file(str(dataset / s["file"]))
        used = shard_positions(head, shard)
        want_x.append(shard_inputs(head, shard)[used])
        want_y.append(shard["accept_prob"][used])
    assert torch.equal(x.float(), torch.cat(want_x)) and torch.equal(y, torch.cat(want_y))
    assert x.shape[1] == head.in_dim and (x.dtype == torch.float32) == (inputs != "hidden")
    if inputs == "stats":  # no state read: the rows' state part is zeros
        assert (x[:, :16] == 0).all()
    elif clean:
        raw = [load_file(str(dataset / s["file"])) for s in m["splits"]["train"]["shards"]]
        assert len(ds) == m["splits"]["train"]["n_tokens"]  # every Y_i, mixed or not
        key = "context_features" if feature == "context" else "features"
        assert torch.equal(x[:, :16].float(), torch.cat([r[key] for r in raw]).float())


def test_stats_need_datagen_draft_stats(tmp_path):
    old = make_dataset(tmp_path / "old", seqs={"train": 4, "dev": 2}, stats=False)
    cfg = TrainConfig(data=str(old), inputs="hidden+stats")
    with pytest.raises(UserError, match="inputs=hidden\\+stats needs the draft statistics \\(shard tensor draft_stats\\)"
                                        ".*regenerate the dataset with the current `adaptive-spec datagen` "
                                        "\\(or train inputs=hidden\\)"):
        load_split(cfg, read_manifest(old), "train", None)
    assert len(load_split(TrainConfig(data=str(old)), read_manifest(old), "train", None))
    with pytest.raises(UserError, match="inputs' must be one of hidden, hidden\\+stats, stats"):
        load_config(TrainConfig, None, [f"data={old}", "inputs=logits"])
    with pytest.raises(UserError, match="inputs=stats reads no hidden state: set feature=context"):
        load_config(TrainConfig, None, [f"data={old}", "inputs=stats"])
    with pytest.raises(UserError, match="ece_bins must be >= 2"):
        load_config(TrainConfig, None, [f"data={old}", "ece_bins=1"])


def test_positions_and_features_follow_the_format(dataset):
    cfg = TrainConfig(data=str(dataset))
    m = read_manifest(dataset)
    ds = load_split(cfg, m, "train", None)
    raw = [load_file(str(dataset / s["file"])) for s in m["splits"]["train"]["shards"]]
    mask = torch.cat([r["loss_mask"] for r in raw]).bool()
    assert len(ds) == int(mask.sum()) == m["splits"]["train"]["n_loss_tokens"]
    x, y = ds.gather(torch.arange(len(ds)))
    assert torch.equal(x, torch.cat([r["features"] for r in raw])[mask])
    assert torch.equal(y, torch.cat([r["accept_prob"] for r in raw])[mask])
    cfg2 = TrainConfig(data=str(dataset), target="expected_accept")
    assert torch.equal(load_split(cfg2, m, "train", None).target, torch.cat([r["expected_accept"] for r in raw])[mask])
    xb, yb = ds.__getitems__([5, 0, 3])  # the DataLoader's batched fetch keeps the order
    assert torch.equal(xb, x[[5, 0, 3]]) and torch.equal(yb, y[[5, 0, 3]])


def test_context_feature_pairs_each_target_with_the_previous_state(dataset, tmp_path):
    """feature=context: Y_i's target with the state after Z_{i-1}, at every position of a response
    but its first (mixed or not: that state never saw Y_i); the head exported remembers it."""
    cfg = TrainConfig(data=str(dataset), feature="context")
    m = read_manifest(dataset)
    ds = load_split(cfg, m, "train", None)
    want_x, want_y = [], []
    for s in m["splits"]["train"]["shards"]:
        t = load_file(str(dataset / s["file"]))
        ro = t["resp_offsets"].tolist()
        for k in range(len(ro) - 1):
            want_x.append(t["features"][ro[k]: ro[k + 1] - 1])
            want_y.append(t["accept_prob"][ro[k] + 1: ro[k + 1]])
    x, y = ds.gather(torch.arange(len(ds)))
    assert torch.equal(x, torch.cat(want_x)) and torch.equal(y, torch.cat(want_y))
    assert len(ds) == m["splits"]["train"]["n_tokens"] - m["splits"]["train"]["n_prompts"]
    with pytest.raises(UserError, match="feature must be one of token, context"):
        TrainConfig(data=str(dataset), feature="hidden").validate()
    nofeat = make_dataset(tmp_path / "nofeat", seqs={"train": 4}, features=False)
    with pytest.raises(UserError, match="store_features=true"):
        load_split(TrainConfig(data=str(nofeat), feature="context"), read_manifest(nofeat), "train", None)


def test_features_from_the_draft_when_the_dataset_has_none(tmp_path, tiny_pair, monkeypatch):
    draft_dir, _ = tiny_pair
    ds = make_dataset(tmp_path / "ds", seqs={"train": 6, "dev": 3}, features=False, draft_name=str(draft_dir))
    cfg = TrainConfig(data=str(ds), output_dir=str(tmp_path / "run"))
    acc = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), wait_for_everyone=lambda: None)
    m = read_manifest(ds)
    # the features come from the draft that made the data, checked by its weights' fingerprint
    with pytest.raises(UserError, match="fingerprint"):
        load_split(cfg, m, "train", acc)
    from adaptive_spec.backends.runner import model_fingerprint
    from adaptive_spec.backends.models import load_model

    model, _ = load_model(str(draft_dir), "draft", dtype="fp32")
    m["models"]["draft"]["fingerprint"] = model_fingerprint(model)
    got = load_split(cfg, m, "train", acc)
    # By hand: the draft's final hidden state at the position of Z_i in prompt+Z, for loss positions.
    want = []
    for s in m["splits"]["train"]["shards"]:
        t = load_file(str(ds / s["file"]))
        for k in range(len(t["prompt_lens"])):
            ids = t["input_ids"][t["input_offsets"][k]: t["input_offsets"][k + 1]].long()[None]
            h = model.base_model(input_ids=ids).last_hidden_state[0].detach()
            mask = t["loss_mask"][t["resp_offsets"][k]: t["resp_offsets"][k + 1]].bool()
            want.append(h[int(t["prompt_lens"][k]):][mask])
    x, _ = got.gather(torch.arange(len(got)))
    torch.testing.assert_close(x.float(), torch.cat(want), atol=2e-2, rtol=1e-2)  # cached in bf16
    assert (tmp_path / "run" / "features" / "train.safetensors").is_file()
    # Cached: a second load does not run the draft again.
    monkeypatch.setattr("adaptive_spec.datagen.features.load_model", lambda *a, **k: pytest.fail("draft rerun"))
    again = load_split(cfg, m, "train", acc)
    assert torch.equal(again.feats[0], got.feats[0])


# ---------------------------------------------------------------- end to end

def final_weights(out: Path) -> dict:
    """The model.safetensors of the run's last checkpoint (saved at its last step)."""
    _, path = RunFiles(out, False).checkpoints()[-1]
    return load_file(str(path / "model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow  # two processes: make test-fast spawns no multi-process training
def test_two_process_run_killed_and_resumed_equals_an_uninterrupted_one(tmp_path, dataset, capsys):
    """accelerate launch --num_processes 2 --cpu (gloo): a run killed at step 6 (os._exit, as a kill:
    last checkpoint at step 4) and resumed ends with the same weights as an uninterrupted run, to
    atol 1e-6 in fp32 (measured: 0.0, the resumed run is bit-exact), and writes the same log."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    r = launch([f"data={dataset}", f"output_dir={full}", *RUN[1:], "report_to=wandb"], processes=2)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((full / "results.json").read_text())
    total = res["total_steps"]
    log = read_jsonl(full / "log.jsonl")
    evals = [row for row in log if row["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == total
    assert evals[-1]["dev_kl"] < 0.8 * evals[0]["dev_kl"]  # the head learned P = f(h)
    assert {"train_loss", "train_kl", "train_ece", "dev_loss", "dev_kl", "dev_ece"} <= set(evals[-1])
    # Evaluation is sharded over the 2 processes and gathered: every position counted once.
    n_dev = len(load_split(TrainConfig(data=str(dataset)), read_manifest(dataset), "dev", None))
    assert evals[-1]["dev_n"] == n_dev
    assert [row["step"] for row in log if row["kind"] == "train"][:3] == [2, 4, 6]
    assert (full / "reliability.png").stat().st_size > 0 and (full / "head" / "reliability.png").is_file()
    assert list((full / "wandb").glob("offline-run-*"))  # the tracker ran (offline)
    assert len(RunFiles(full, False).checkpoints()) == 2  # keep_checkpoints: accelerate's total_limit
    head = AcceptanceHead.from_pretrained(full / "head", hidden_size=16)
    assert head.draft_model == "tiny-draft" and head.draft_fingerprint == "fp-draft" and head.depth == 2
    assert head.extra["w_rej"] == 1.0 and head.extra["step"] == res["best_step"]
    card = (full / "head" / "README.md").read_text()  # the model card names data, config and dev metrics
    assert "D=2, w_rej=1" in card and f"step {res['best_step']}" in card
    assert f"| kl | {head.extra['metrics']['train_kl']:.4f} | {head.extra['metrics']['dev_kl']:.4f} |" in card

    # Killed after step 6 (last checkpoint: step 4), then resumed: the same weights and log.
    r = launch([f"data={dataset}", f"output_dir={killed}", *RUN, "stop_after_steps=6"], processes=2)
    assert r.returncode != 0
    ckpts = RunFiles(killed, False).checkpoints()
    assert [json.loads((p / "trainer_state.json").read_text())["step"] for _, p in ckpts] == [4]
    assert max(row["step"] for row in read_jsonl(killed / "log.jsonl")) == 6
    r = launch([f"data={dataset}", f"output_dir={killed}", *RUN, "--resume"], processes=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"from {ckpts[-1][1]} (step 4/{total})" in r.stdout + r.stderr
    assert read_jsonl(killed / "log.jsonl") == log
    assert max_abs_diff(final_weights(killed), final_weights(full)) <= 1e-6
    assert max_abs_diff(load_file(str(killed / "head/model.safetensors")),
                        load_file(str(full / "head/model.safetensors"))) <= 1e-6

    # A new run in a used folder, or a resume with changed settings, is refused (before any work).
    for extra, msg in [([], "already holds a run"), (["lr=0.5", "--resume"], "lr: 0.01 -> 0.5")]:
        (killed / "results.json").unlink(missing_ok=True)
        assert train.main([f"data={dataset}", f"output_dir={killed}", *RUN, *extra]) == 2
        assert msg in capsys.readouterr().err


def test_ctrl_c_prints_one_line_with_the_resume_command(tmp_path, dataset):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"data={dataset}", f"output_dir={out}", *RUN, "epochs=100000"]
    # the child starts with SIGINT at its default (a parent that ignores SIGINT would hand the
    # child SIG_IGN, and Python keeps an inherited SIG_IGN: the Ctrl-C would never arrive)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the Ctrl-C goes in once the run says it saved a checkpoint (its own line on stderr): no clock, no polling
    seen = ""
    for chunk in proc.stderr:
        seen += chunk
        if "checkpoint saved:" in chunk:
            break
    assert "checkpoint saved:" in seen, seen[-3000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = seen + err
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("interrupted: last checkpoint ") and f"{out}/checkpoints/checkpoint_" in line
    assert line.endswith(f"resume with: python train.py data={dataset} output_dir={out} {' '.join(RUN)} "
                         "epochs=100000 --resume")


def test_help_lists_the_config_keys(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert all(f"  {k} [" in text for k in TrainConfig.model_fields)
    assert "--mixed_precision" in text


def test_the_launcher_decides_mixed_precision(capsys):
    cfg = TrainConfig(data="x", mixed_precision="bf16")
    assert runfiles.mixed_precision_kwargs(cfg, env={"ACCELERATE_MIXED_PRECISION": "no"}) == {}
    assert "ignored: the launcher set no" in capsys.readouterr().err
    assert runfiles.mixed_precision_kwargs(cfg, env={}) == {"mixed_precision": "bf16"}
    auto = TrainConfig(data="x")
    assert runfiles.mixed_precision_kwargs(auto, env={"ACCELERATE_MIXED_PRECISION": "fp16"}) == {}
    assert capsys.readouterr().err == ""


def test_sweep_writes_the_table_and_skips_finished_heads(tmp_path, dataset):
    args = ["--sweep", f"data={dataset}", f"output_dir={tmp_path / 'sweep'}", *RUN, "epochs=1", "eval_every=100",
            "depths=[0,1]", "w_rejs=[1,3]"]
    r = launch(args, accelerate=False)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "sweep" / "sweep.md").read_text().splitlines()
    assert md[0].startswith("| depth | w_rej | best_step | train_loss | train_kl")
    assert len(md) == 2 + 4
    csv = (tmp_path / "sweep" / "sweep.csv").read_text().splitlines()
    assert len(csv) == 1 + 4 and csv[1].startswith("0,1.0,")
    assert sorted(p.name for p in (tmp_path / "sweep").glob("d*_wrej*")) == ["d0_wrej1", "d0_wrej3", "d1_wrej1", "d1_wrej3"]
    r = launch(args, accelerate=False)
    assert r.returncode == 0 and r.stderr.count("already finished") == 4
    assert (tmp_path / "sweep" / "sweep.md").read_text().splitlines() == md


def test_stats_head_trains_on_token_data_without_features(tmp_path):
    """inputs=stats needs no hidden states: it trains on datagen's token data alone (e.g. the committed
    data/datagen/mix), learns the part of P that depends on log q, and a hidden-state head on the same
    folder is refused for want of features."""
    data = make_dataset(tmp_path / "ds", seqs={"train": 48, "dev": 16}, features=False, stats_weight=3.0)
    args = [f"data={data}", "report_to=none", "epochs=4", "batch_size=32", "lr=3e-2", "warmup_ratio=0.1",
            "eval_every=10", "save_every=0", "depth=0", "w_rej=1", "feature=context", "inputs=stats"]
    r = launch([*args, f"output_dir={tmp_path / 'run'}"], accelerate=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["best"]["dev_auc"] > 0.75
    head = AcceptanceHead.from_pretrained(tmp_path / "run" / "head")
    assert head.inputs == "stats" and head.feature == "context" and head.out.in_features == 3
    r = launch([*args[:-1], "inputs=hidden", f"output_dir={tmp_path / 'hidden'}"], accelerate=False)
    assert r.returncode == 2 and "feature=context needs stored draft features" in r.stderr


def test_partial_data_trains_on_the_shards_written_so_far(tmp_path, dataset):
    """A dataset datagen is still growing: refused by default, trained on its listed shards with
    partial_data=true, and the head says so."""
    import shutil

    grow = tmp_path / "growing"
    shutil.copytree(dataset, grow)
    m = json.loads((grow / "manifest.json").read_text())
    kept = m["splits"]["train"]["shards"][:1]
    m["splits"]["train"] = {**m["splits"]["train"], "shards": kept,
                            "n_tokens": sum(s["n_tokens"] for s in kept),
                            "n_loss_tokens": sum(s["n_loss_tokens"] for s in kept)}
    (grow / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    args = [f"data={grow}", *RUN, "epochs=1", "eval_every=100"]
    r = launch([*args, f"output_dir={tmp_path / 'refused'}"], accelerate=False)
    assert r.returncode == 2 and "partial_data=true" in r.stderr
    r = launch([*args, f"output_dir={tmp_path / 'run'}", "partial_data=true"], accelerate=False)
    assert r.returncode == 0, r.stderr[-3000:]
    head = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert head["partial_data"] is True
    full = read_manifest(dataset)
    assert head["n_train_positions"] == len(load_split(
        TrainConfig(data=str(grow)), read_manifest(grow, partial=True), "train", None))
    assert head["n_train_positions"] < len(load_split(TrainConfig(data=str(dataset)), full, "train", None))


# ---------------------------------------------------------------- the input ablation (eval/score_heads.py ablate)

def score_heads_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("score_heads", ROOT / "eval" / "score_heads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ablation_trains_the_grid_resumes_and_reports_per_source(tmp_path, tiny_pair, capsys):
    """hidden / hidden+stats / context heads on data where P depends on log q(Y_i) as well as on the
    state: the stats head learns what the others cannot see. Per-source dev metrics, recomputed
    from shard_inputs rows, add up to the dev metrics training measured on its own rows. A rerun
    skips every finished head. The stats head then drives the learned policy on the tiny pair."""
    data = make_dataset(tmp_path / "ds", seqs={"train": 48, "dev": 16}, stats_weight=3.0, sources=["gsm8k", "code"])
    # the same kind of data with target-prefix states: every position scored, context heads on their own states
    clean = make_dataset(tmp_path / "clean", seqs={"train": 4, "dev": 16}, stats_weight=3.0, sources=["gsm8k", "code"],
                         clean=True, seed=5)
    out = tmp_path / "abl"
    args = ["eval/score_heads.py", "ablate", "--data", str(data), "--out", str(out), "--depths", "0", "--w-rejs", "1",
            "--eval-data", str(clean), "report_to=none", "epochs=4", "batch_size=32", "lr=3e-2", "warmup_ratio=0.1", "eval_every=10",
            "save_every=0", "log_every=5"]
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    table = json.loads((out / "ablation.json").read_text())
    rows = {row["inputs"]: row for row in table["rows"]}
    assert list(rows) == ["hidden", "hidden+stats", "context"] and table["sources"] == ["gsm8k", "code"]
    assert rows["hidden+stats"]["dev_kl"] < 0.8 * rows["hidden"]["dev_kl"]
    assert rows["hidden+stats"]["dev_auc"] > rows["hidden"]["dev_auc"]
    md = (out / "ablation.md").read_text()
    assert "| inputs | D | w_rej | training positions | best step | dev KL | dev AUC | dev ECE | eval KL | eval AUC | " \
           "eval ECE | eval gsm8k: KL / AUC / ECE | eval code: KL / AUC / ECE |" in md
    cm = read_manifest(clean)
    n_clean = cm["splits"]["dev"]["n_tokens"]
    raw = [load_file(str(clean / s["file"])) for s in cm["splits"]["dev"]["shards"]]
    want = metrics.auc(torch.cat([r["draft_stats"][:, 0] for r in raw]), torch.cat([r["accept_prob"] for r in raw]))
    assert table["reference_log_q_auc"]["all"] == pytest.approx(want) and f"AUC {want:.4f}" in md
    for row in rows.values():
        assert row["eval"]["n"] == n_clean and row["eval"]["n"] == sum(row["eval_by_source"][s]["n"] for s in ("gsm8k", "code"))
    assert rows["hidden+stats"]["eval"]["auc"] > rows["hidden"]["eval"]["auc"]
    for name in ("hidden-d0-wrej1", "hidden-stats-d0-wrej1", "context-d0-wrej1"):
        res = json.loads((out / name / "results.json").read_text())
        by = json.loads((out / name / "ablation.json").read_text())
        assert by["all"]["n"] == res["best"]["dev_n"] == by["gsm8k"]["n"] + by["code"]["n"]
        for k in ("kl", "auc", "ece", "loss"):
            assert by["all"][k] == pytest.approx(res["best"][f"dev_{k}"], abs=1e-5)
        card = (out / name / "head" / "README.md").read_text()
        assert "Dev metrics per prompt source" in card and f"| code | {by['code']['n']} |" in card
        assert "prompt sources: gsm8k, code" in card
    head = AcceptanceHead.from_pretrained(out / "hidden-stats-d0-wrej1" / "head", hidden_size=16)
    assert head.inputs == "hidden+stats" and head.stats_params.top_k == 0  # the manifest's datagen sampling
    m = read_manifest(data)
    st = torch.cat([load_file(str(data / s["file"]))["draft_stats"][load_file(str(data / s["file"]))["loss_mask"].bool()]
                    for s in m["splits"]["train"]["shards"]]).double()
    torch.testing.assert_close(head.stats_mean, st.mean(0).float())  # standardized by the training positions
    torch.testing.assert_close(head.stats_std, st.std(0, correction=0).float())

    run = json.loads((out / "run.json").read_text())
    assert (run["script"], run["report_args"]) == ("eval/score_heads.py", ["ablate"])  # what --report-only needs
    (out / "ablation.md").unlink()
    assert score_heads_module().main([*run["report_args"], "--report-only", "--out", str(out)]) == 0
    assert (out / "ablation.md").read_text() == md

    r2 = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and r2.stderr.count("already finished") == 3, r2.stderr[-3000:]
    assert (out / "ablation.md").read_text() == md

    draft, target = map(str, tiny_pair)
    run = ["generate", "--prompt", "abc", "--draft", draft, "--target", target, "--dtype", "fp32", "--temperature", "0",
           "--max-new-tokens", "20", "--json"]
    assert cli_main([*run, "--policy", "learned", "--head", str(out / "hidden-stats-d0-wrej1" / "head"),
                     "--threshold", "0.7"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert cli_main([*run, "--policy", "ar"]) == 0
    assert spec["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


def test_ablation_refuses_bad_grids(tmp_path, dataset, capsys):
    mod = score_heads_module()
    for argv, msg in [(["--variants", "hidden,logits"], "--variants takes a comma-separated list of hidden, "
                                                          "hidden+stats, context, context+stats, stats"),
                      (["--depths", "0,7"], "depths must be in 0..4"),
                      (["--w-rejs", "x"], "--w-rejs takes a comma-separated list of positive numbers"),
                      (["--eval-data", str(make_dataset(tmp_path / "other", seqs={"train": 4, "dev": 4}, sources=["gsm8k", "code"]))],
                       "has prompt sources ['gsm8k', 'code'], --data has []")]:
        assert mod.main(["ablate", "--data", str(dataset), "--out", str(tmp_path / "a"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()
