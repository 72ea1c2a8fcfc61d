"""`adaptive-spec generate` end to end on tiny models, and one clear error line for bad input."""
import json

import pytest

from adaptive_spec.cli import main
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
        "missing": "does not exist", "k0": "--k must be >= 1", "neg_temp": "temperature must be >= 0",
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
