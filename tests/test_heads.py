import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import hub_mixin
from safetensors.torch import load_file

from adaptive_spec.errors import UserError
from adaptive_spec.heads.features import MIN_LOG_Q, STATS, draft_stats
from adaptive_spec.heads.head import INPUTS, AcceptanceHead, load_head, shard_inputs, shard_positions
from adaptive_spec.decoding.sampling import SamplingParams


def test_residual_blocks_do_not_share_parameters():
    head = AcceptanceHead(8, depth=4)
    weights = [b.linear.weight for b in head.blocks]
    assert len(weights) == 4
    assert len({w.data_ptr() for w in weights}) == 4
    n_params = sum(p.numel() for p in head.parameters())
    assert n_params == 4 * (8 * 8 + 8) + 8 + 1  # shared blocks would count once
    before = [w.detach().clone() for w in weights]
    with torch.no_grad():
        weights[0].add_(1.0)
    for w, b in zip(weights[1:], before[1:]):
        assert torch.equal(w, b)


def test_forward_is_the_resnet_of_the_paper():
    torch.manual_seed(0)
    head = AcceptanceHead(6, depth=2)
    h = torch.randn(3, 5, 6)
    x = h
    for b in head.blocks:
        x = x + torch.nn.functional.silu(b.linear(x))
    want = head.out(x).squeeze(-1)
    assert head(h).shape == (3, 5)
    torch.testing.assert_close(head(h), want)
    torch.testing.assert_close(head.acceptance_prob(h), torch.sigmoid(want))
    lin = AcceptanceHead(6, depth=0)  # D = 0: a single linear layer
    assert len(list(lin.parameters())) == 2
    torch.testing.assert_close(lin(h), h @ lin.out.weight[0] + lin.out.bias[0])


def test_input_is_cast_to_the_head_dtype():
    head = AcceptanceHead(4, depth=1)
    out = head(torch.randn(2, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    assert head.to(torch.bfloat16)(torch.randn(2, 4)).dtype == torch.bfloat16


def test_bad_depth_is_refused():
    with pytest.raises(UserError, match="depth"):
        AcceptanceHead(4, depth=5)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(1)
    head = AcceptanceHead(16, depth=3, draft_model="tiny-draft", draft_fingerprint="abc")
    head.save_pretrained(tmp_path / "h", extra={"w_rej": 6.0, "depth": 99})
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["hidden_size"] == 16 and cfg["depth"] == 3  # metadata cannot override the architecture
    assert cfg["draft_model"] == "tiny-draft" and cfg["draft_fingerprint"] == "abc" and cfg["w_rej"] == 6.0
    loaded = AcceptanceHead.from_pretrained(tmp_path / "h", hidden_size=16)
    h = torch.randn(7, 16)
    assert torch.equal(loaded(h), head(h))
    assert loaded.depth == 3 and loaded.draft_model == "tiny-draft" and loaded.draft_fingerprint == "abc"
    assert loaded.extra["w_rej"] == 6.0
    assert not loaded.training
    bf = AcceptanceHead.from_pretrained(tmp_path / "h", dtype=torch.bfloat16, device="cpu")
    assert bf.dtype == torch.bfloat16


def test_feature_is_saved_and_checked(tmp_path):
    AcceptanceHead(16, depth=1, feature="context").save_pretrained(tmp_path / "c")
    assert AcceptanceHead.from_pretrained(tmp_path / "c").feature == "context"
    AcceptanceHead(16, depth=1).save_pretrained(tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["feature"] == "token"
    del cfg["feature"]  # refused, naming the key and what to add
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json has no 'feature'; .* add \"feature\": \"token\" to a head saved"):
        AcceptanceHead.from_pretrained(tmp_path / "t")
    with pytest.raises(UserError, match="feature must be one of token, context"):
        AcceptanceHead(16, feature="prefix")


def test_head_for_another_draft_is_refused(tmp_path):
    AcceptanceHead(896, depth=0, draft_model="Qwen/Qwen2.5-Coder-0.5B-Instruct").save_pretrained(tmp_path / "h")
    with pytest.raises(UserError) as e:
        AcceptanceHead.from_pretrained(tmp_path / "h", hidden_size=1536, draft_model="big-draft")
    msg = str(e.value)
    assert "trained for draft model 'Qwen/Qwen2.5-Coder-0.5B-Instruct' (hidden size 896)" in msg
    assert "hidden size 1536" in msg and "big-draft" in msg and "train a head for this draft" in msg


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        AcceptanceHead.from_pretrained(tmp_path / "nope")
    d = AcceptanceHead(4, depth=1).save_pretrained(tmp_path / "h")
    weights = (d / "model.safetensors").read_bytes()

    (d / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        AcceptanceHead.from_pretrained(d)

    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # truncated
    with pytest.raises(UserError, match="model.safetensors is corrupt"):
        AcceptanceHead.from_pretrained(d)

    (d / "model.safetensors").write_bytes(weights)
    cfg = (d / "config.json").read_text()
    (d / "config.json").write_text(cfg[:10])
    with pytest.raises(UserError, match="config.json is corrupt"):
        AcceptanceHead.from_pretrained(d)

    (d / "config.json").write_text(cfg.replace('"depth": 1', '"depth": 2'))  # weights no longer match
    with pytest.raises(UserError, match="does not match config.json"):
        AcceptanceHead.from_pretrained(d)

    (d / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        AcceptanceHead.from_pretrained(d)


# Logits of each committed head on torch.randn(4, 896, generator=manual_seed(0)), recorded with the
# loader as it was before heads moved onto PyTorchModelHubMixin: the committed folders must load
# unchanged and compute the same function. The depth-3 heads are stored as float16 (checkpoints/README.md,
# "Storage"): their logits stay within 1e-3 of the float32 ones recorded here; the depth-0 ones are float32.
COMMITTED = {
    "qwen-coder-0.5b-d0-wrej1": [2.23421049118042, 2.2490813732147217, 2.0386528968811035, 2.042095899581909],
    "qwen-coder-0.5b-d0-wrej6": [0.4495367109775543, 0.45803186297416687, 0.24474328756332397, 0.24773457646369934],
    "qwen-coder-0.5b-d3-wrej1": [2.409303903579712, 2.6051037311553955, 1.953974962234497, 1.9413138628005981],
    "qwen-coder-0.5b-d3-wrej1-context": [2.169219493865967, 2.200791120529175, 1.734668493270874, 2.0552804470062256],
    "qwen-coder-0.5b-d3-wrej6": [0.6500842571258545, 0.8558855652809143, 0.1659427434206009, 0.15146993100643158],
}
CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_committed_heads_load_unchanged(name):
    head = load_head(CHECKPOINTS / name, hidden_size=896, draft_model="default")
    x = torch.randn(4, 896, generator=torch.Generator().manual_seed(0))
    fp16 = "-d3-" in name
    stored = {t.dtype for t in load_file(CHECKPOINTS / name / "model.safetensors").values()}
    assert stored == ({torch.float16} if fp16 else {torch.float32})
    assert all(p.dtype == torch.float32 for p in head.parameters())  # loading casts back
    torch.testing.assert_close(head(x), torch.tensor(COMMITTED[name]), atol=1e-3 if fp16 else 1e-6, rtol=0)
    assert head.feature == ("context" if name.endswith("context") else "token")
    assert head.extra["metrics"]["dev_kl"] > 0 and head.draft_model == "default"
    # trained before `inputs` existed (their config.json had it added since): the hidden state alone
    assert head.inputs == "hidden" and head.in_dim == 896 and not list(head.buffers())


def fake_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """The layout hf_hub_download reads offline: refs/main -> snapshots/<commit>/files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    return cache


def test_heads_load_by_hub_id(tmp_path, monkeypatch):
    torch.manual_seed(3)
    head = AcceptanceHead(16, depth=2, draft_model="tiny-draft", feature="context")
    head.save_pretrained(tmp_path / "h", extra={"w_rej": 3.0})
    cache = fake_hub_cache(tmp_path / "cache", "someone/tiny-head", tmp_path / "h")
    loaded = AcceptanceHead.from_pretrained("someone/tiny-head", hidden_size=16, cache_dir=cache, local_files_only=True)
    h = torch.randn(5, 16)
    assert torch.equal(loaded(h), head(h)) and loaded.feature == "context" and loaded.extra["w_rej"] == 3.0
    with pytest.raises(UserError, match="trained for draft model 'tiny-draft' \\(hidden size 16\\)"):
        AcceptanceHead.from_pretrained("someone/tiny-head", hidden_size=24, cache_dir=cache, local_files_only=True)


def test_unknown_hub_id_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="could not be fetched from the Hugging Face hub"):
        AcceptanceHead.from_pretrained("someone/no-such-head", cache_dir=tmp_path, local_files_only=True)
    with pytest.raises(UserError, match="does not exist"):
        load_head(tmp_path / "a" / "b")


def test_push_to_hub_uploads_a_loadable_head(tmp_path, monkeypatch):
    pushed = tmp_path / "pushed"

    class FakeApi:  # what the mixin's push_to_hub calls; no network
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id, folder_path, **kwargs):
            shutil.copytree(folder_path, pushed)
            return f"https://huggingface.co/{repo_id}/commit/x"

    monkeypatch.setattr(hub_mixin, "HfApi", FakeApi)
    torch.manual_seed(4)
    head = AcceptanceHead(8, depth=1, draft_model="tiny-draft")
    head.extra = {"w_rej": 6.0}
    assert head.push_to_hub("someone/head").endswith("/commit/x")
    assert sorted(p.name for p in pushed.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = (pushed / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: adaptive-spec") and "# Acceptance head: D=1, w_rej=6" in card
    loaded = AcceptanceHead.from_pretrained(pushed, hidden_size=8)
    h = torch.randn(3, 8)
    assert torch.equal(loaded(h), head(h)) and loaded.extra == {"w_rej": 6.0}


# ---------------------------------------------------------------- inputs: the draft's own statistics

def test_draft_stats_by_hand():
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0],   # y = 1
                      [0.0, 0.0, 1.0, 0.0],     # a point mass (greedy q)
                      [0.25, 0.25, 0.25, 0.25],  # uniform: entropy log 4, no margin
                      [0.5, 0.25, 0.25, 0.0]])  # y = 3 outside the support: log q floored, finite
    y = torch.tensor([1, 2, 0, 3])
    s = draft_stats(q, y)
    assert s.shape == (4, 3) and s.dtype == torch.float32 and torch.isfinite(s).all()
    want = torch.tensor([[math.log(0.25), 1.5 * math.log(2), 0.25],
                         [0.0, 0.0, 1.0],
                         [math.log(0.25), math.log(4), 0.0],
                         [MIN_LOG_Q, 1.5 * math.log(2), 0.25]])
    torch.testing.assert_close(s, want, atol=1e-6, rtol=0)
    assert STATS == ("log_q", "entropy", "margin")
    # one row at a time (the decoder) equals the batch (datagen), bit for bit
    g = torch.Generator().manual_seed(0)
    qb = (3 * torch.randn(5, 7, 1000, generator=g)).softmax(-1)
    yb = torch.randint(0, 1000, (5, 7), generator=g)
    sb = draft_stats(qb, yb)
    assert sb.shape == (5, 7, 3)
    assert all(torch.equal(sb[i, j], draft_stats(qb[i, j], yb[i, j])) for i in range(5) for j in range(7))


def test_truncated_stats_equal_the_full_pass():
    """The decoder's shortcut (top-2k partial sort) gives datagen's rows: with top-k, with bf16
    logits that tie at the k-th value (more than k nonzeros), where ties overflow 2k (the full
    pass), without top-k, and when it reuses the decoder's own q (same parameters) or not."""
    from adaptive_spec.heads.features import step_stats, truncated_stats
    from adaptive_spec.decoding.sampling import process_logits

    g = torch.Generator().manual_seed(3)
    V, k = 5000, 8
    ties = 3 * torch.randn(V, generator=g)
    order = ties.topk(k + 3).indices
    ties[order[k - 2:]] = float(ties[order[k - 2]])  # 5 tokens tie at the k-th value: k + 3 nonzeros (bf16 logits do this)
    flat = torch.zeros(V)
    flat[:40] = 5.0  # 40 tokens tie at the top: more than 2k nonzeros, the full pass must run
    cases = [3 * torch.randn(V, generator=g), ties, flat]
    for logits in cases:
        for sp in (SamplingParams(1.0, k, 1.0), SamplingParams(0.7, k, 0.9), SamplingParams(1.0, 0, 1.0)):
            q = process_logits(logits, sp)
            for y in (int(q.argmax()), int(torch.multinomial(q, 1, generator=g)), int(q.argmin())):
                y = torch.tensor(y)
                want = draft_stats(q, y)
                torch.testing.assert_close(truncated_stats(q, y, sp.top_k), want, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(step_stats(logits, y, sp), want, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(step_stats(logits, y, sp, q, sp), want, atol=1e-6, rtol=1e-6)
                # the decoder's q made with other parameters (greedy here) is not reused
                greedy = process_logits(logits, SamplingParams(0.0))
                torch.testing.assert_close(step_stats(logits, y, sp, greedy, SamplingParams(0.0)), want,
                                           atol=1e-6, rtol=1e-6)
    assert int((process_logits(ties, SamplingParams(1.0, k, 1.0)) > 0).sum()) == k + 3


def test_stats_head_standardizes_its_stats_and_checks_row_width():
    torch.manual_seed(2)
    head = AcceptanceHead(6, depth=2, inputs="hidden+stats", stats_sampling={"temperature": 1.0, "top_k": 5})
    assert head.in_dim == 9 and head.stats_params == SamplingParams(1.0, 5, 1.0)
    with torch.no_grad():
        head.stats_mean.copy_(torch.tensor([-2.0, 1.0, 0.3]))
        head.stats_std.copy_(torch.tensor([1.5, 0.5, 0.2]))
    x = torch.randn(4, 9)
    z = torch.cat([x[:, :6], (x[:, 6:] - head.stats_mean) / head.stats_std], 1)
    for b in head.blocks:
        z = z + torch.nn.functional.silu(b.linear(z))
    torch.testing.assert_close(head(x), head.out(z).squeeze(-1))
    with pytest.raises(UserError, match="reads inputs=hidden\\+stats \\(rows of 9: hidden state \\+ 3 draft stats\\) "
                                        "but was given rows of 6"):
        head(torch.randn(4, 6))
    with pytest.raises(UserError, match="inputs must be one of hidden, hidden\\+stats, stats"):
        AcceptanceHead(6, inputs="logits")


def test_stats_only_head_reads_the_stats_and_ignores_the_state(tmp_path):
    torch.manual_seed(4)
    head = AcceptanceHead(6, depth=2, feature="context", inputs="stats")
    assert head.in_dim == 9 and head.out.in_features == 3 and all(b.linear.in_features == 3 for b in head.blocks)
    with torch.no_grad():
        head.stats_mean.copy_(torch.tensor([-2.0, 1.0, 0.3]))
        head.stats_std.copy_(torch.tensor([1.5, 0.5, 0.2]))
    x = torch.randn(4, 9)
    z = (x[:, 6:] - head.stats_mean) / head.stats_std
    for b in head.blocks:
        z = z + torch.nn.functional.silu(b.linear(z))
    torch.testing.assert_close(head(x), head.out(z).squeeze(-1))
    y = x.clone()
    y[:, :6] = torch.randn(4, 6)  # another state, the same stats: the same prediction
    assert torch.equal(head(y), head(x))
    with pytest.raises(UserError, match="inputs=stats reads no hidden state.*set feature=context"):
        AcceptanceHead(6, inputs="stats")
    head.save_pretrained(tmp_path / "s", extra={"partial_data": True, "metrics": {}, "prefix": "target"})
    loaded = AcceptanceHead.from_pretrained(tmp_path / "s", hidden_size=6)
    assert loaded.inputs == "stats" and torch.equal(loaded(x), head(x))
    card = (tmp_path / "s" / "README.md").read_text()
    assert "the statistics of each candidate under the draft's own q, not a hidden state" in card
    assert "no hidden state, only the draft's statistics" in card and "(partial_data)" in card


def test_stats_head_round_trip_and_old_configs(tmp_path):
    torch.manual_seed(3)
    head = AcceptanceHead(8, depth=1, feature="context", inputs="hidden+stats",
                          stats_sampling={"temperature": 0.7, "top_k": 50, "top_p": 0.9})
    with torch.no_grad():
        head.stats_mean.normal_()
        head.stats_std.uniform_(0.5, 2)
    head.save_pretrained(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["inputs"] == "hidden+stats" and cfg["stats_sampling"] == {"temperature": 0.7, "top_k": 50, "top_p": 0.9}
    loaded = AcceptanceHead.from_pretrained(tmp_path / "s", hidden_size=8)
    x = torch.randn(5, 11)
    assert torch.equal(loaded(x), head(x)) and torch.equal(loaded.stats_std, head.stats_std)
    assert loaded.inputs == "hidden+stats" and loaded.feature == "context"
    assert loaded.stats_params == SamplingParams(0.7, 50, 0.9)
    assert "inputs `hidden+stats`" in (tmp_path / "s" / "README.md").read_text()
    AcceptanceHead(8, depth=1).save_pretrained(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["inputs"] == "hidden" and "stats_sampling" not in cfg
    del cfg["inputs"]  # refused, naming the key and what to add
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json has no 'inputs'; .* add \"inputs\": \"hidden\" to a head saved"):
        AcceptanceHead.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "inputs": "hidden+logits"}))
    with pytest.raises(UserError, match="names inputs 'hidden\\+logits'; this version reads hidden, hidden\\+stats"):
        AcceptanceHead.from_pretrained(tmp_path / "h")


def test_callers_that_supply_the_hidden_state_only_refuse_stats_heads():
    head = AcceptanceHead(8, depth=0, inputs="hidden+stats")
    with pytest.raises(UserError, match="tree_estimator 'head' can supply inputs hidden but this head was trained "
                                        "with inputs=hidden\\+stats; use a head trained with inputs=hidden"):
        load_head(head, why="tree_estimator 'head'")
    assert load_head(head, inputs=INPUTS) is head
    assert load_head(AcceptanceHead(8, depth=0)).inputs == "hidden"


@pytest.fixture
def shard(tmp_path):
    from safetensors.torch import load_file

    from train_fixtures import make_dataset

    root = make_dataset(tmp_path / "ds", seqs={"train": 5})
    return load_file(str(root / "train" / "shard-00000.safetensors"))


@pytest.mark.parametrize("feature,inputs", [("token", "hidden"), ("token", "hidden+stats"), ("context", "hidden"),
                                            ("context", "hidden+stats"), ("context", "stats")])
def test_shard_inputs_per_input_set(shard, feature, inputs):
    head = AcceptanceHead(16, depth=1, feature=feature, inputs=inputs)
    rows, used = shard_inputs(head, shard), shard_positions(head, shard)
    T = shard["loss_mask"].numel()
    assert rows.shape == (T, head.in_dim) and rows.dtype == torch.float32 and used.shape == (T,)
    feats, starts = shard["features"].float(), shard["resp_offsets"][:-1]
    if inputs == "stats":  # no state read: zeros, and the shard's features are not needed
        feats = torch.zeros_like(feats)
        no_feats = {k: v for k, v in shard.items() if k != "features"}
        assert torch.equal(shard_inputs(head, no_feats), rows)
    if feature == "token":
        assert torch.equal(rows[:, :16], feats) and torch.equal(used, shard["loss_mask"].bool())
    else:  # the state before each position; none before a response's first
        assert torch.equal(rows[1:, :16][used[1:]], feats[:-1][used[1:]])
        assert (rows[starts, :16] == 0).all() and not used[starts].any() and used.sum() == T - len(starts)
    if inputs != "hidden":
        assert torch.equal(rows[:, 16:], shard["draft_stats"])
    assert torch.isfinite(head(rows)).all()


def test_shard_inputs_errors(shard):
    stats_head = AcceptanceHead(16, depth=0, inputs="hidden+stats")
    no_stats = {k: v for k, v in shard.items() if k != "draft_stats"}
    with pytest.raises(UserError, match="regenerate the dataset with the current `adaptive-spec datagen`"):
        shard_inputs(stats_head, no_stats)
    assert shard_inputs(AcceptanceHead(16, depth=0), no_stats).shape[1] == 16  # a hidden head needs no stats
    with pytest.raises(UserError, match="store_features=true"):
        shard_inputs(stats_head, {k: v for k, v in shard.items() if k != "features"})
    with pytest.raises(UserError, match="draft_stats has shape"):
        shard_inputs(stats_head, {**shard, "draft_stats": shard["draft_stats"][:, :2]})


def test_the_public_api_loads_a_saved_head_into_a_decoder_in_five_lines(tiny_pair, tmp_path):
    """The README's example, on the tiny pair: the package names the head class, and a head saved
    by training loads and drives the learned policy with no module path to know."""
    import adaptive_spec
    from adaptive_spec import AcceptanceHead, SpecPair

    assert {"AcceptanceHead", "load_head", "LearnedThreshold", "NgramPolicy"} <= set(adaptive_spec.__all__)
    draft, target = tiny_pair
    AcceptanceHead(16, depth=1, feature="context", inputs="stats").save_pretrained(tmp_path / "head")
    pair = SpecPair.load(draft=str(draft), target=str(target), dtype="fp32")
    head = AcceptanceHead.from_pretrained(tmp_path / "head")
    pair.decoder.eos = set()  # the random tiny target may draw its EOS at once: run the 8 tokens
    g = pair.generate([1, 2, 3], policy="learned", head=head, threshold=0.3, max_new_tokens=8)
    assert len(g.token_ids) == 8 and g.metrics.n_drafted > 0
