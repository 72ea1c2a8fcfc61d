import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import hub_mixin

from adaptive_spec.errors import UserError
from adaptive_spec.heads import AcceptanceHead, load_head


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
    del cfg["feature"]  # a head saved before `feature` existed reads as a token head
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    assert AcceptanceHead.from_pretrained(tmp_path / "t").feature == "token"
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
# unchanged and compute the same function.
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
    torch.testing.assert_close(head(x), torch.tensor(COMMITTED[name]), atol=1e-6, rtol=0)
    assert head.feature == ("context" if name.endswith("context") else "token")
    assert head.extra["metrics"]["dev_kl"] > 0 and head.draft_model == "default"


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
