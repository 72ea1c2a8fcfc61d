"""Engines declare what they can do; policies say what they need; one check matches the two.

A third engine is one module and one registration: here a toy one (MockLM's trigram tables behind the
runner interface), registered in the test, runs every chain policy through the public API
(SpecPair.load / generate) without a line of decoding/, evaluation/ or cli.py knowing it exists.
"""
import subprocess
import sys
import time

import pytest
import torch

import exact
from adaptive_spec import SpecPair, UserError
from adaptive_spec.backends import engines
from adaptive_spec.decoding.sampling import SamplingParams
from adaptive_spec.heads.head import AcceptanceHead
from adaptive_spec.params import check_runs_on, policy_params
from exact import chi_square_pvalue
from tiny import MockLM, make_tokenizer

V, L, N = 5, 3, 2000


class ToyRunner(MockLM):
    """The runner protocol: forward / rollback / reset / length, counters, fingerprint, numeric path."""

    def fingerprint(self) -> str:
        return f"toy-{self._args}"

    def numeric_path(self) -> dict:
        return {"engine": "toy", "table": list(self._args)}


def load_toy(params):
    target = ToyRunner(V, seed=0)
    draft = ToyRunner(V, seed=1) if params.draft is not None else None
    return engines.Loaded(target, draft, make_tokenizer(32), [], {"toy": True})


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))  # the toy's measured costs stay here
    engine = engines.register(engines.Engine("toy", load_toy, description="trigram tables, for tests"))
    yield engine
    engines._ENGINES.pop("toy")


def stats_head():
    torch.manual_seed(0)
    return AcceptanceHead(2, depth=1, feature="context", inputs="stats")


CHAIN = [("fixed", {"k": 2}), ("learned", {"head": None, "threshold": 0.5, "k_max": 3}),
         ("confidence", {"threshold": 0.4}), ("entropy", {"threshold": 1.0}), ("heuristic", {"k": 2}),
         ("ngram", {"k": 2, "ngram_min": 1}), ("ngram", {"fallback": "learned", "head": None, "threshold": 0.5})]


@pytest.mark.parametrize("name,kw", CHAIN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CHAIN)])
def test_a_registered_engine_runs_every_chain_policy_exactly(toy, name, kw):
    pair = SpecPair.load(backend="toy")
    assert pair.backend == "toy" and pair.draft_config == {"toy": True}
    kw = {k: (stats_head() if k == "head" else v) for k, v in kw.items()}
    params = SamplingParams(1.0)
    probs = exact.exact_sequence_probs(pair.target, [1, 2, 1, 2], params, V, L)
    counts = {}
    for s in range(N):
        g = pair.generate([1, 2, 1, 2], policy=name, max_new_tokens=L, temperature=1.0, seed=s, **kw)
        counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
    assert chi_square_pvalue(counts, probs, N) > 1e-3


def test_the_oracle_and_greedy_run_on_it(toy):
    pair = SpecPair.load(backend="toy")
    ref = pair.generate([1, 2, 3], policy="ar", temperature=0, max_new_tokens=20).token_ids
    for name, kw in (("oracle", {}), ("fixed", {"k": 3}), ("ngram", {"k": "auto"})):
        assert pair.generate([1, 2, 3], policy=name, temperature=0, max_new_tokens=20, **kw).token_ids == ref


def test_a_policy_that_needs_what_an_engine_lacks_is_refused_naming_what_runs(toy):
    with pytest.raises(UserError) as e:
        check_runs_on(policy_params("tree"), "toy")
    msg = str(e.value)
    assert "policy 'tree' does not run on the toy backend: it needs a token-tree pass" in msg
    assert "policies that do run there: ar, fixed, learned" in msg and "or use --backend torch" in msg
    check_runs_on(policy_params("ngram"), "toy")  # needs nothing
    with pytest.raises(UserError, match="unknown backend 'toy2'; valid backends: torch, llama.cpp, toy"):
        engines.get("toy2")


@pytest.mark.parametrize("argv,needle", [
    (["--backend", "llama.cpp", "--policy", "tree"], "policy 'tree' does not run on the llama.cpp backend"),
    (["--policy", "fixed", "--draft-qant", "int8"], "unrecognized arguments: --draft-qant"),
    (["--policy", "fixed", "--backend", "vllm"], "unknown backend 'vllm'; valid backends: torch, llama.cpp"),
])
def test_a_mismatch_or_a_misspelling_is_refused_in_one_line_before_any_model_loads(argv, needle):
    """Through the installed command, timed from outside: the refusal comes before any weights load."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "adaptive_spec.cli", "generate", "--prompt", "hi", *argv],
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2 and lines[-1].startswith("error:") and needle in lines[-1], p.stderr
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    print(f"refused in {time.perf_counter() - t0:.1f} s: {lines[-1]}")


def test_no_module_outside_backends_compares_an_engine_name():
    """The engine abstraction holds: only backends/ (and messages) spell "llama.cpp"; setup/ builds it."""
    out = subprocess.run(["git", "grep", "-n", '"llama.cpp"', "--", "adaptive_spec", ":!adaptive_spec/backends",
                          ":!adaptive_spec/setup"],
                         capture_output=True, text=True, cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    hits = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert hits == [], hits
