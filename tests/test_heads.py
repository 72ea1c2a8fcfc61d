import json

import pytest
import torch

from adaptive_spec.errors import UserError
from adaptive_spec.heads import AcceptanceHead


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
