"""Typed settings (adaptive_spec.params): every policy's and the pair's settings are checked once, by
their class, before any model loads; unknown keys are refused with the valid ones listed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_spec import typed
from adaptive_spec.cli import main
from adaptive_spec.errors import UserError
from adaptive_spec.params import PairParams, pair_params, policy_params


@pytest.mark.parametrize("name", [n for n in typed.policy_names() if n != "ar"])
def test_every_policy_refuses_a_misspelled_key_and_lists_its_own(name):
    fields = list(typed.policy_class(name).model_fields)
    with pytest.raises(UserError, match=rf"treshold: not a setting of policy {name} \(its settings: "
                                        rf"{', '.join(fields)}\)"):
        policy_params(name, treshold=0.5)


def test_defaults_and_coercion():
    assert policy_params("fixed").k == 4 and policy_params("fixed", k="6").k == 6
    assert policy_params("heuristic").k == 5 and policy_params("confidence").threshold == 0.4
    assert policy_params("entropy", threshold="1.5").threshold == 1.5
    p = policy_params("spectr", num_drafts=2)
    assert (p.num_drafts, p.k) == (2, 4) and p.model_fields_set == {"num_drafts"}
    with pytest.raises(Exception):  # frozen: a checked value cannot be changed unchecked afterwards
        p.k = 0


@pytest.mark.parametrize("values,needle", [
    ({"threshold": 0.0}, "threshold must be h in (0, 1) or auto for policy learned, got 0.0"),
    ({"threshold": 1.0}, "threshold must be h in (0, 1) or auto"),
    ({"threshold": "high"}, "threshold must be h in (0, 1) or auto"),
    ({"head": "checkpoints/qwen-coder-0.5b-d3-wrej6"}, "needs --threshold h in (0, 1)"),
    ({"threshold": 0.5}, "needs a trained acceptance head"),
    ({"threshold": 0.5, "head": "no/such/dir/here"}, "does not exist"),
    ({"threshold": 0.5, "head": "checkpoints/qwen-coder-0.5b-d3-wrej6", "k_max": 0}, "k_max must be an integer >= 1"),
    ({"threshold": 0.5, "head": "checkpoints/qwen-coder-0.5b-d3-wrej6", "curve": "x.json"}, "--curve is read only"),
])
def test_learned_settings(values, needle):
    with pytest.raises(UserError) as e:
        policy_params("learned", **values)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_head_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="has no model.safetensors"):
        policy_params("learned", head=str(tmp_path), threshold=0.5)
    with pytest.raises(UserError, match="has no model.safetensors"):
        policy_params("tree", tree_estimator="head", head=str(tmp_path))
    assert policy_params("learned", head="owner/a-hub-head", threshold=0.5).head == "owner/a-hub-head"


def test_settings_that_do_not_apply_are_refused():
    with pytest.raises(UserError, match="--curve is read only by --k auto"):
        policy_params("fixed", k=3, curve="c.json")
    with pytest.raises(UserError, match="--head is read by the tree policies only with --tree-estimator head"):
        policy_params("tree", head="checkpoints/qwen-coder-0.5b-d3-wrej6")
    with pytest.raises(UserError, match="--tree-node-cost applies only with --tree-learned"):
        policy_params("ersd", tree_node_cost=0.2)
    with pytest.raises(UserError, match="threshold auto is for --policy learned"):
        policy_params("confidence", threshold="auto")
    with pytest.raises(UserError, match="k auto is for --policy fixed"):
        policy_params("heuristic", k="auto")


def test_oracle_refuses_sampling_before_anything_runs():
    with pytest.raises(UserError, match="greedy decoding"):
        policy_params("oracle").check_sampling(1.0)
    policy_params("oracle").check_sampling(0.0)


@pytest.mark.parametrize("values,needle", [
    ({"backend": "llama.cpp", "dtype": "fp32"}, "dtype='fp32' (--dtype): the llama.cpp backend"),
    ({"backend": "llama.cpp", "device": "cuda"}, "device='cuda' (--device): the llama.cpp backend"),
    ({"n_ctx": 512}, "n_ctx=512 (--n-ctx): the torch backend (Hugging Face weights, the default pair dequantized to bf16) reads no such setting; drop it or use --backend llama.cpp"),
    ({"backend": "vllm"}, "unknown backend 'vllm'; valid backends: torch, llama.cpp"),
    ({"draft_quant": "int3"}, "draft_quant must be none, int8, int4 (torch), or q4_0, q8_0, q4_0-pure, q4_k-pure, iq4_nl-pure (llama.cpp)"),
    ({"draft_vocab": 0}, "--draft-vocab must be a token count >= 1"),
    ({"threads": 0}, "threads must be an integer >= 1"),
    ({"dtpye": "fp32"}, "dtpye: not a setting of the model pair (its settings: target, draft, backend, dtype"),
])
def test_pair_settings(values, needle):
    with pytest.raises(UserError) as e:
        pair_params(**values)
    assert needle in str(e.value)


def test_specpair_load_refuses_before_loading(monkeypatch):
    from adaptive_spec.backends import torch_engine
    from adaptive_spec.decoding import pipeline

    monkeypatch.setattr(torch_engine, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(UserError, match=r"dtype='bf16' \(--dtype\): the llama.cpp backend"):
        pipeline.SpecPair.load(backend="llama.cpp", dtype="bf16")
    with pytest.raises(UserError, match="pass the settings dtype inside the PairParams"):  # one way in, not two
        pipeline.SpecPair.load(PairParams(), dtype="fp32")


def test_draft_vocab_above_the_vocabulary_is_refused_before_loading(tiny_pair, monkeypatch, capsys):
    from adaptive_spec.decoding import pipeline

    monkeypatch.setattr(pipeline.SpecPair, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    draft, target = map(str, tiny_pair)
    code = main(["generate", "--prompt", "hi", "--draft", draft, "--target", target, "--draft-vocab", "10000000"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--draft-vocab must be in 1..32" in err, err


def test_abbreviated_flags_are_refused(capsys, monkeypatch):
    from adaptive_spec.decoding import pipeline

    monkeypatch.setattr(pipeline.SpecPair, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    code = main(["generate", "--prompt", "hi", "--policy", "confidence", "--thresh", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "unrecognized arguments: --thresh" in err and err.count("\n") == 1, err


def test_the_generation_path_loads_no_training_or_evaluation_module(tiny_pair):
    """`import adaptive_spec` and a generation on tiny models: nothing of datagen, training or
    evaluation, nor their libraries, is imported (a fresh interpreter, so other tests cannot hide it)."""
    draft, target = map(str, tiny_pair)
    code = f"""
import json, sys
import adaptive_spec
from adaptive_spec import SpecPair
pair = SpecPair.load(target={target!r}, draft={draft!r}, dtype="fp32", device="cpu")
pair.generate("abc", policy="fixed", k=3, max_new_tokens=6)
print(json.dumps(sorted(sys.modules)))
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    offline = ("adaptive_spec.datagen", "adaptive_spec.training", "adaptive_spec.evaluation", "adaptive_spec.setup.fetch",
               "adaptive_spec.setup.pair", "adaptive_spec.setup.wheels", "adaptive_spec.setup.convert")
    banned = {m for m in loaded if m.startswith(offline)} | (loaded & {"wandb", "datasets", "matplotlib", "sklearn"})
    assert "adaptive_spec.decoding.pipeline" in loaded and not banned, sorted(banned)


def test_pair_presets_name_both_models_by_hub_id():
    p = pair_params(pair="coder-0.5b-7b")
    assert (p.draft, p.target) == ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-7B-Instruct")
    assert (pair_params(pair="default").draft, pair_params(pair="default").target) == ("default", "default")
    for values, needle in (({"pair": "7b"}, "unknown pair preset '7b'; presets: default, coder-0.5b-7b"),
                           ({"pair": "qwen-1.5b-7b", "draft": "x/y"}, "drop --draft or --pair"),
                           ({"pair": "qwen-1.5b-7b", "backend": "llama.cpp"}, "loads gguf files")):
        with pytest.raises(UserError, match=needle):
            pair_params(**values)


def test_graph_runtimes_are_refused_where_they_cannot_run_before_any_weights():
    """GPU-only choices fail as settings (no torch), and auto resolves per device at load."""
    from adaptive_spec.backends.torch_engine import runtime_for

    assert pair_params().kv_cache == "auto" and pair_params().runtime == "auto"
    with pytest.raises(UserError, match="--runtime compile needs the static KV cache: add --kv-cache static"):
        pair_params(kv_cache="dynamic", runtime="compile")
    with pytest.raises(UserError, match="--runtime cudagraph captures CUDA graphs: use a GPU"):
        pair_params(device="cpu", runtime="cudagraph")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert runtime_for("auto", "auto", cpu) == ("dynamic", "eager")  # the CPU path is unchanged
    assert runtime_for("auto", "auto", cuda) == ("static", "compile")
    assert runtime_for("static", "auto", cpu) == ("static", "eager")
    with pytest.raises(UserError, match="--runtime cudagraph captures CUDA graphs, and this pair runs on cpu"):
        runtime_for("auto", "cudagraph", cpu)


def test_the_fused_decoder_is_chosen_where_it_pays():
    """auto: on a GPU's static cache only (a CPU keeps its path); asked for where it cannot run, refused."""
    from adaptive_spec.backends.torch_engine import _fused_for
    from tiny import make_model

    m = make_model(16)
    assert _fused_for(m, "auto", "static") is False  # a CPU model: unchanged
    assert _fused_for(m, True, "static") is True
    with pytest.raises(UserError, match="--fused true needs the static KV cache"):
        pair_params(kv_cache="dynamic", fused=True)
    m.config.hidden_act = "gelu"
    with pytest.raises(UserError, match="--fused true: the fused decoder supports the SiLU MLP only"):
        _fused_for(m, True, "static")


def test_draft_vocab_full_names_the_whole_vocabulary():
    """`--draft-vocab full` (or none) is the default spelled out; control: 0 is still refused."""
    assert pair_params(draft_vocab="full").draft_vocab == "full"
    assert pair_params(draft_vocab="none").draft_vocab == "none"
    with pytest.raises(UserError, match="token count >= 1"):
        pair_params(draft_vocab="0")
