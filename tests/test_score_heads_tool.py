"""eval/score_heads.py, the one head-scoring tool: its subcommands parse, keep the defaults and files of the
scripts they replace (probe_heads, ablate_heads, llama_cpp_head_drift), and `probe` runs end to end on a
tiny draft. The ablate subcommand's end-to-end run is in test_training.py (it trains heads)."""
import json
import runpy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from script_tools import heavy_imports
from train_fixtures import make_dataset

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "eval" / "score_heads.py"
SUBCOMMANDS = ("probe", "ablate", "llama-cpp-drift")


@pytest.fixture(scope="module")
def tool():
    """The script's names (main, parser): run as a module would be imported, not as __main__."""
    return SimpleNamespace(**runpy.run_path(str(TOOL)))


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_help_parses(tool, name, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: eval/score_heads.py {name} ") and "--report-only" in out and "--out OUT" in out
    assert f"python eval/score_heads.py {name} " in out  # its command example, from the subcommand's docstring


def test_an_unknown_or_missing_subcommand_lists_the_valid_ones(tool, capsys):
    for argv in (["probe_heads"], []):
        with pytest.raises(SystemExit) as e:
            tool.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "probe,ablate,llama-cpp-drift" in err, err


def test_each_subcommand_keeps_its_former_scripts_defaults(tool):
    """One --data / --out / --report-only definition for all, yet each subcommand its own defaults (a single
    shared argparse parent would hand every subcommand the last one's)."""
    p = tool.parser()
    probe, ablate, drift = (p.parse_args([name]) for name in SUBCOMMANDS)
    assert (probe.data, probe.out, probe.split, probe.heads) == (
        "runs/datagen/gsm8k", "eval/results/probe_heads", "dev", ["checkpoints/*"])
    assert (ablate.data, ablate.out, ablate.variants, ablate.depths, ablate.w_rejs, ablate.overrides) == (
        None, "runs/heads/ablation", "hidden,hidden+stats,context", "0,3", "1,6", [])
    assert (drift.data, drift.out, drift.split, drift.sequences, drift.threads, drift.seed) == (
        "data/datagen/mix", "eval/results/llama_cpp_head_drift", "dev", 48, 2, 0)
    assert drift.head == "checkpoints/qwen-coder-0.5b-int8-stats-d3"
    assert not any(a.report_only for a in (probe, ablate, drift))
    assert p.parse_args(["ablate", "--depths", "0", "epochs=2"]).overrides == ["epochs=2"]
    with pytest.raises(SystemExit):
        p.parse_args(["probe", "--sequences", "3"])  # another subcommand's option


def test_ablate_needs_data_unless_report_only(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["ablate", "--out", "nowhere"])
    assert e.value.code == 2 and "the following arguments are required: --data" in capsys.readouterr().err


def test_the_former_scripts_are_gone_and_no_result_names_them():
    for old in ("probe_heads", "ablate_heads", "llama_cpp_head_drift"):
        assert not (ROOT / "eval" / f"{old}.py").exists()
    for run in (ROOT / "eval" / "results").glob("*/run.json"):
        header = json.loads(run.read_text())
        assert (ROOT / header["script"]).is_file(), f"{run}: {header['script']} does not exist"
        if header["script"] == "eval/score_heads.py":
            assert header["report_args"][0] in SUBCOMMANDS, run


def test_report_only_loads_no_torch(tmp_path):
    """--report-only rebuilds a committed report on a machine without torch: nothing the tool imports
    before it measures may load it."""
    copy = shutil.copytree(ROOT / "eval" / "results" / "ablate_heads_mix_target", tmp_path / "abl")
    (copy / "ablation.md").unlink()
    assert heavy_imports(TOOL, ["ablate", "--report-only", "--out", str(copy)]) == []
    assert (copy / "ablation.md").read_text() == (ROOT / "eval/results/ablate_heads_mix_target/ablation.md").read_text()


def test_probe_scores_every_predictor_and_its_table_regenerates(tool, tiny_pair, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from adaptive_spec.heads.head import AcceptanceHead

    draft, _ = tiny_pair  # hidden size 16, as the synthetic states
    data = make_dataset(tmp_path / "ds", seqs={"train": 4, "dev": 16})
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["config"].update(draft=str(draft), dtype="fp32")  # the draft datagen ran (its LM head is loaded)
    (data / "manifest.json").write_text(json.dumps(manifest))
    heads = tmp_path / "heads"
    AcceptanceHead(16, depth=0).save_pretrained(heads / "tok")
    AcceptanceHead(16, depth=0, feature="context", inputs="hidden+stats").save_pretrained(heads / "ctx")
    (heads / "not-a-head").mkdir()
    out = tmp_path / "probe"
    assert tool.main(["probe", "--data", str(data), "--heads", str(heads / "*"), "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert capsys.readouterr().out == table
    results = json.loads((out / "results.json").read_text())
    assert [r["predictor"] for r in results["rows"]] == [
        "constant (mean P)", "draft confidence q(y)", "draft entropy -H(q)", "head ctx (context, hidden+stats)",
        "head tok (token, hidden)", "logistic(q(y), H)", "logistic(q(y), H, ctx)", "logistic(q(y), H, tok)",
        "logistic(q(y), H, all heads)"]
    assert [r["kl"] is None for r in results["rows"]] == [False, True, True] + [False] * 6
    # the scored tokens: loss positions but each response's first (its context state is not stored)
    shards = [load_file(str(data / s["file"])) for s in manifest["splits"]["dev"]["shards"]]
    P = []
    for sh in shards:
        keep = sh["loss_mask"].bool()
        keep[sh["resp_offsets"][:-1]] = False
        P.append(sh["accept_prob"][keep])
    P = torch.cat(P)
    run = json.loads((out / "run.json").read_text())
    assert results["n"] == len(P) and run["mean_p"] == pytest.approx(P.mean().item())
    assert (run["script"], run["report_args"], run["report"]) == ("eval/score_heads.py", ["probe"], "table.md")
    assert f"dev: {len(P)} draft tokens" in table and "| head tok (token, hidden) | " in table
    # what tests/test_regenerate_reports.py runs on a committed folder
    (out / "table.md").unlink()
    assert tool.main([*run["report_args"], "--report-only", "--out", str(out)]) == 0
    assert (out / "table.md").read_text() == table
