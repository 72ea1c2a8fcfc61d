"""`adaptive-spec generate` end to end on tiny models, and one clear error line for bad input."""
import json

import pytest

from adaptive_spec.cli import main
from adaptive_spec.errors import UserError
from tiny import save_model


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(tiny_pair, capsys):
    draft, target = tiny_pair
    code, out, _ = run(capsys, "generate", "--prompt", "abc", "--draft", str(draft), "--target", str(target),
                       "--dtype", "fp32", "--k", "3", "--temperature", "0", "--max-new-tokens", "20", "--json")
    assert code == 0
    res = json.loads(out)
    assert set(res) >= {"text", "token_ids", "metrics"}
    m = res["metrics"]
    for key in ("n_tokens", "n_draft_forwards", "n_target_forwards", "n_discarded", "discard_rate",
                "verification_rate", "acceptance_rate", "wall_s"):
        assert key in m
    assert m["n_tokens"] == len(res["token_ids"]) <= 20
    # greedy speculative == greedy target-only, through the CLI too
    code, out_ar, _ = run(capsys, "generate", "--prompt", "abc", "--target", str(target), "--policy", "ar",
                          "--dtype", "fp32", "--temperature", "0", "--max-new-tokens", "20", "--json")
    assert json.loads(out_ar)["token_ids"] == res["token_ids"]


def test_generate_streams_text_and_metrics_line(tiny_pair, capsys):
    draft, target = tiny_pair
    code, out, err = run(capsys, "generate", "--prompt", "ab", "--draft", str(draft), "--target", str(target),
                         "--dtype", "fp32", "--max-new-tokens", "10", "--chat")
    assert code == 0
    assert "tok/s" in err and "N_target/N" in err


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("other") / "m", vocab_size=20, hidden_size=16, seed=5)


@pytest.mark.parametrize("case", ["vocab", "empty", "too_long", "missing", "k0", "neg_temp", "policy"])
def test_bad_input_gives_one_clear_line(case, tiny_pair, other_vocab_model, capsys):
    draft, target = map(str, tiny_pair)
    args = {"prompt": "abc", "draft": draft, "target": target}
    extra = []
    expect = {
        "vocab": "vocabularies differ", "empty": "prompt is empty", "too_long": "context",
        "missing": "does not exist", "k0": "--k must be an integer >= 1", "neg_temp": "temperature must be >= 0",
        "policy": "unknown policy",
    }[case]
    if case == "vocab":
        args["draft"] = str(other_vocab_model)
    elif case == "empty":
        args["prompt"] = "  "
    elif case == "too_long":
        args["prompt"] = "a" * 200  # tiny models have a 128-token context
    elif case == "missing":
        args["target"] = "./no/such/model"
    elif case == "k0":
        extra = ["--k", "0"]
    elif case == "neg_temp":
        extra = ["--temperature", "-1"]
    elif case == "policy":
        extra = ["--policy", "nonsense"]
    code, out, err = run(capsys, "generate", "--prompt", args["prompt"], "--draft", args["draft"],
                         "--target", args["target"], "--dtype", "fp32", *extra)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if any model would load: argument checks must come first."""
    from adaptive_spec.decoding import pipeline

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(pipeline.SpecPair, "load", classmethod(refuse))


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"adaptive-spec {version('adaptive_spec')}"


@pytest.mark.parametrize("extra, expect", [
    (["--policy", "learnd"], "unknown policy 'learnd'"),
    (["--k", "0"], "--k must be an integer >= 1"),
    (["--policy", "confidence", "--k-max", "0"], "--k-max must be an integer >= 1"),
    (["--k-max", "8"], "--k-max: not a setting of policy fixed (its settings: --k, --curve)"),
    (["--policy", "tree", "--num-drafts", "2"], "--num-drafts: not a setting of policy tree"),
    (["--policy", "fixed", "--threshold", "0.5"], "--threshold: not a setting of policy fixed"),
    (["--policy", "ersd", "--num-drafts", "2"], "--num-drafts applies to ersd only with --drafting batch"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--policy", "learned", "--threshold", "0.7"], "needs a trained acceptance head"),
    (["--policy", "learned", "--head", "./no/head", "--threshold", "0.7"], "does not exist"),
    (["--policy", "learned", "--head", ".", "--threshold", "1.5"], "--threshold must be h in (0, 1)"),
    (["--policy", "learned", "--head", ".", "--threshold", "0.5"], "has no config.json or model.safetensors"),
    (["--policy", "entropy", "--threshold", "0"], "must be tau > 0 nats"),
    (["--policy", "oracle", "--temperature", "1"], "greedy decoding"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--draft-quant", "int3"], "invalid choice"),
    (["--draft-vocab", "0"], "--draft-vocab must be a token count >= 1"),
    (["--draft-vocab", "-5"], "--draft-vocab must be a token count >= 1"),
    (["--draft-vocab", "no/such/list.safetensors"], "does not exist"),
    (["--policy", "confidence", "--threshold", "auto"], "--threshold auto is for --policy learned"),
    (["--k", "auto"], "--k auto needs a predicted curve"),
    (["--k", "auto", "--curve", "no/such/curve.json"], "no/such/curve.json, which does not exist"),
    (["--policy", "entropy", "--k", "auto"], "--k auto is for --policy fixed"),
    (["--k", "two"], "--k must be an integer >= 1 or auto for policy fixed, got 'two'"),
    (["--policy", "tree", "--tree-node-cost", "0"], "--tree-node-cost must be > 0"),
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:N"),
])
def test_arguments_are_refused_before_any_model_loads(extra, expect, no_model_load, capsys):
    code = main(["generate", "--prompt", "abc", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expect in err, err


def test_policy_choices_come_from_the_registry(capsys):
    from adaptive_spec import cli

    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    names = cli.typed.policy_names()
    assert {"ar", "fixed", "learned"} <= set(names) and all(n in out for n in names)


def test_every_flag_has_help():
    from adaptive_spec import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    for action in sub.choices["generate"]._actions + parser._actions:
        assert action.help, action.option_strings


@pytest.mark.parametrize("cmd, cls, key", [("datagen", "DatagenConfig", "mix_ratio"),
                                           ("sweep", "SweepConfig", "thresholds")])
def test_help_lists_config_keys(cmd, cls, key, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"config keys" in out and cls in out and f"  {key} [" in out and "  out_dir [''" in out


def test_train_help_lists_config_keys(capsys):
    try:
        code = main(["train", "--help"])
    except SystemExit as e:  # argparse's --help exit, when it is not caught on the way
        code = e.code
    out = capsys.readouterr().out
    assert code == 0 and "config keys" in out and "TrainConfig" in out and "  depth [3]" in out and "  w_rej [" in out


def test_train_subcommand_delegates(monkeypatch):
    from adaptive_spec.training import train as training

    seen = []
    monkeypatch.setattr(training, "main", lambda argv: seen.append(argv))
    assert main(["train", "--config", "configs/train/default.yaml", "epochs=1"]) == 0
    assert seen == [["--config", "configs/train/default.yaml", "epochs=1"]]


@pytest.mark.parametrize("cmd, module, says", [("datagen", "datagen.generate", "finished shards are kept"),
                                               ("sweep", "evaluation.sweep", "finished runs are kept"),
                                               ("report", "evaluation.report", "no report was written"),
                                               ("fetch-models", "setup.fetch", "rerun the same command")])
def test_ctrl_c_prints_one_line(cmd, module, says, monkeypatch, capsys):
    import importlib

    mod = importlib.import_module(f"adaptive_spec.{module}")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    for name in ("run", "build_report", "fetch_default_pair"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, interrupted)
    argv = {"report": ["--sweep-dir", "x"], "fetch-models": []}.get(cmd, ["dataset=x.jsonl"] if cmd == "datagen" else [])
    assert main([cmd, *argv]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: ") and says in lines[0]


def test_draft_configuration_errors_and_runtime_record(tiny_pair, tmp_path, capsys):
    """A --draft-vocab larger than the vocabulary and a token list of another tokenizer each get
    one line; a good configuration is recorded in --json's runtime with the CPU's flags."""
    from collections import Counter

    from adaptive_spec.backends.vocab import save_token_list
    from tiny import make_tokenizer

    draft, target = tiny_pair
    base = ["generate", "--prompt", "abc", "--draft", str(draft), "--target", str(target), "--dtype", "fp32",
            "--max-new-tokens", "6", "--json"]
    code, _, err = run(capsys, *base, "--draft-vocab", "99999")
    assert code == 2 and err.startswith("error: --draft-vocab must be in 1..32") and err.count("\n") == 1, err
    other = save_token_list(tmp_path / "other.safetensors", make_tokenizer(20), Counter({5: 1}), "test")
    code, _, err = run(capsys, *base, "--draft-vocab", str(other))
    assert code == 2 and "counted with another tokenizer" in err and err.count("\n") == 1, err
    mine = save_token_list(tmp_path / "mine.safetensors", make_tokenizer(32), Counter({5: 3, 7: 1}), "test", always=[1])
    code, out, _ = run(capsys, *base, "--draft-vocab", f"{mine}:3", "--draft-quant", "int8")
    assert code == 0, out
    rt = json.loads(out)["runtime"]
    assert rt["draft_quant"] == "int8" and rt["draft_vocab"] == f"{mine}:3"
    assert rt["draft_path"]["quant"] == "int8" and rt["target_path"]["dtype"] == "float32"
    assert {"isa", "cpu_flags", "bf16_kernels"} <= set(rt["machine"])


@pytest.fixture
def saved_head(tmp_path):
    import torch

    from adaptive_spec.heads.head import AcceptanceHead

    torch.manual_seed(0)
    AcceptanceHead(16, depth=0).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def test_threshold_auto_without_a_curve_is_one_line(saved_head, no_model_load, capsys):
    code = main(["generate", "--prompt", "abc", "--policy", "learned", "--head", str(saved_head), "--threshold", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"{saved_head}/threshold_curve.json" in err and f"adaptive-spec autotune --head {saved_head} --data" in err


def test_autotune_then_generate_with_threshold_auto(tiny_pair, saved_head, tmp_path, monkeypatch, capsys):
    from train_fixtures import make_dataset

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    data = make_dataset(tmp_path / "data", hidden_size=16)
    code, out, err = run(capsys, "autotune", "--head", str(saved_head), "--data", str(data))
    assert code == 0 and (saved_head / "threshold_curve.json").is_file() and "| h=0.05 |" in out and "| K=1 |" in out, err
    draft, target = tiny_pair
    code, out, err = run(capsys, "generate", "--prompt", "abc", "--draft", str(draft), "--target", str(target),
                         "--dtype", "fp32", "--policy", "learned", "--head", str(saved_head), "--threshold", "auto",
                         "--temperature", "0", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    result = json.loads(out)
    auto = result["auto"]
    if auto["value"] == "ar":  # tiny models: a draft step costs about a target step, so no h pays
        assert "auto: h = none (the target alone" in err and result["metrics"]["n_drafted"] == 0
        assert auto["ar_tokens_per_s"] > max(auto["predicted"].values())
    else:
        assert auto["kind"] == "h" and f"auto: h = {auto['value']:g}" in err
    code, _, err = run(capsys, "autotune", "--data", str(data))
    assert code == 2 and err.count("\n") == 1 and "--out FILE" in err, err


def test_tree_flags_reach_the_policy_factory(monkeypatch, capsys):
    from adaptive_spec.decoding import pipeline

    seen = []

    class Pair:
        def generate(self, prompt, **kw):
            seen.append(kw)
            raise UserError("recorded")

    monkeypatch.setattr(pipeline.SpecPair, "load", classmethod(lambda cls, params: Pair()))
    assert main(["generate", "--prompt", "abc", "--policy", "tree", "--tree-learned", "--tree-node-cost", "0.5"]) == 2
    assert main(["generate", "--prompt", "abc", "--policy", "tree"]) == 2
    first, second = (kw["policy"] for kw in seen)  # typed TreeParams, checked once
    assert first.tree_learned is True and first.tree_node_cost == 0.5
    assert second.tree_learned is False and second.tree_node_cost is None
    assert {"tree_learned", "tree_node_cost"} == first.model_fields_set


def test_sigterm_stops_like_ctrl_c(capsys):
    """`kill` (SIGTERM) on a long command takes the Ctrl-C path: one line saying what was kept,
    exit 143, and the previous SIGTERM handler is back afterwards."""
    import os
    import signal

    from adaptive_spec.errors import run_main

    def body(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause() if hasattr(signal, "pause") else None  # the handler raises before this returns

    before = signal.getsignal(signal.SIGTERM)
    assert run_main(body, None, "finished shards are kept") == 143
    assert signal.getsignal(signal.SIGTERM) is before
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["interrupted: finished shards are kept"]


def test_streamed_text_is_the_generated_text(tiny_pair):
    """The streamer (transformers' TextStreamer, fed per round) emits, joined, exactly the final text."""
    from adaptive_spec import SpecPair

    draft, target = map(str, tiny_pair)
    pair = SpecPair.load(target=target, draft=draft, dtype="fp32", device="cpu")
    for seed in range(3):
        chunks = []
        g = pair.generate("ab cd", policy="fixed", k=3, max_new_tokens=40, seed=seed, on_text=chunks.append)
        assert "".join(chunks) == g.text and len(chunks) >= 1


# ---- a GPU this torch cannot reach: one line before any model loads ----------------------------------------

CPU_ONLY = ("2.13.0+cpu", None)  # torch's version file as a CPU-only build writes it (engines._torch_build)


@pytest.fixture
def cpu_only_torch(monkeypatch):
    from adaptive_spec.backends import engines

    monkeypatch.setattr(engines, "_torch_build", lambda: CPU_ONLY)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "abc", "--device", "cuda"],
                                  ["generate", "--prompt", "abc", "--policy", "ar", "--device", "cuda:0"],
                                  ["probe", "--head", "none", "--device", "cuda"]])
def test_a_cuda_device_on_a_cpu_only_torch_is_one_line(argv, cpu_only_torch, no_model_load, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --device {argv[-1]}: "), err
    assert "(2.13.0+cpu) is a CPU-only build" in err and "a CUDA build of torch" in err and "--device cpu" in err


def test_a_sweep_config_naming_cuda_is_refused_before_its_models(cpu_only_torch, tmp_path, monkeypatch, capsys):
    from adaptive_spec.evaluation import sweep

    monkeypatch.setattr(sweep, "load_pairs", lambda *a: pytest.fail("the sweep loaded its models first"))
    out = tmp_path / "sweep"
    code = main(["sweep", "--config", "configs/sweep/smoke.yaml", "pair.device=cuda", f"out_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: pair.device='cuda': this torch (2.13.0+cpu)"), err
    assert "pair.device='cpu'" in err and err.count("\n") == 1 and not out.exists(), err


def test_the_python_api_refuses_cuda_before_any_weights(tiny_pair, cpu_only_torch, monkeypatch):
    from adaptive_spec import SpecPair
    from adaptive_spec.backends import torch_engine

    monkeypatch.setattr(torch_engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    draft, target = map(str, tiny_pair)
    with pytest.raises(UserError, match=r"^device='cuda': this torch \(2.13.0\+cpu\) is a CPU-only build; install "
                                        r"a CUDA build of torch, or run on the CPU with device='cpu'$"):
        SpecPair.load(target=target, draft=draft, device="cuda")


def test_a_cuda_build_that_sees_no_gpu_or_too_few_is_one_line(monkeypatch, no_model_load, capsys):
    """A CUDA build of torch where no GPU is visible, and an index past the GPUs it sees; the broken control,
    a build that sees the GPU asked for, passes the check (and reaches the model load the fixture refuses)."""
    import torch

    from adaptive_spec.backends import engines

    monkeypatch.setattr(engines, "_torch_build", lambda: ("2.11.0+cu130", "13.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--prompt", "abc", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sees no GPU" in err and "CUDA_VISIBLE_DEVICES" in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["generate", "--prompt", "abc", "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda:1: torch sees 1 GPU (cuda:0..cuda:0)") and err.count("\n") == 1, err
    engines.check_device("cuda:0")  # the GPU it sees: no refusal
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["generate", "--prompt", "abc", "--device", "cuda:0"])


def test_this_torch_refuses_cuda_from_the_command_line_without_importing_torch():
    """The real torch of this environment, in a fresh process: where it is a CPU-only build the refusal comes
    from its version file, before torch (or any model) loads."""
    import subprocess
    import sys

    from adaptive_spec.backends import engines

    build = engines._torch_build()
    if build is None or build[1] is not None:
        pytest.skip(f"torch here is a CUDA build ({build}): this checks the CPU-only case")
    code = ("import sys; from adaptive_spec.cli import main; c = main(['generate', '--prompt', 'abc', '--device', "
            "'cuda']); print('torch' in sys.modules, 'transformers' in sys.modules); sys.exit(c)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout.split() == ["False", "False"], (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: --device cuda: this torch"), done.stderr
