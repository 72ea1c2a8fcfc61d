"""A head's threshold curve: the format `adaptive-spec autotune` writes beside a head (training/autotune.py)
and `--threshold auto` / `--k auto` read (adaptive_spec.decoding.auto): per h (and per fixed K) the counts a policy
produces per token, N_target/N and N_discarded/N, replayed offline on datagen data. The counts depend on
the head and the data, not on the machine; auto prices them with this machine's measured costs.

A leaf (stdlib, errors, runs): the typed settings check a curve exists before any model loads, and the
producer (autotune) and the consumer (auto) both read its format from here."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UserError
from ..runs import read_json

FORMAT = "adaptive_spec.threshold_curve.v1"
CURVE_NAME = "threshold_curve.json"


def weights_hash(head_dir) -> str | None:
    f = Path(str(head_dir)).expanduser() / "model.safetensors"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None

def autotune_command(head, data, split: str = "dev", k_max: int = 20, out=None) -> str:
    cmd = "adaptive-spec autotune" + (f" --head {head}" if head else "") + f" --data {data}"
    cmd += "" if split == "dev" else f" --split {split}"
    cmd += "" if k_max == 20 else f" --k-max {k_max}"
    return cmd + (f" --out {out}" if out else "")

def curve_path(source) -> Path:
    p = Path(str(source)).expanduser()
    return p if p.suffix == ".json" else p / CURVE_NAME


def _data_hint(head) -> str:
    """The datagen run a head was trained on (its config.json records it), for the fix's command."""
    try:
        return json.loads((Path(str(head)) / "config.json").read_text()).get("dataset") or "DATAGEN_DIR"
    except (OSError, ValueError, TypeError):
        return "DATAGEN_DIR"


def _fix(source) -> str:
    """How to make the curve `source` names."""
    p = Path(str(source)).expanduser()
    if p.suffix == ".json":
        return f"make it with `{autotune_command('HEAD_DIR', 'DATAGEN_DIR', out=p)}` (--head optional for --k auto)"
    return f"make it with `{autotune_command(source, _data_hint(source))}`"


def load_curve(source, need: str, head=None) -> dict:
    """The curve at `source` (a curve file, or a folder holding one) with the part `need` ("h" or
    "k"); a missing, foreign or stale one is a UserError naming the command that makes one.
    `head` (the head in use, if a folder): its weights must be those the curve was made for."""
    flag = "--threshold auto" if need == "h" else "--k auto"
    if source is None:
        raise UserError(f"{flag} needs a predicted curve: pass --curve FILE (curve=FILE from Python) or --head DIR "
                        f"with a {CURVE_NAME} beside it; {_fix('HEAD_DIR')}")
    path = curve_path(source)
    if not path.is_file():
        raise UserError(f"{flag} needs the predicted curve {path}, which does not exist; {_fix(source)}")
    curve = read_json(path, hint=_fix(source))
    if curve.get("format") != FORMAT:
        raise UserError(f"{path} is not a threshold curve (format {curve.get('format')!r}); {_fix(source)}")
    if need == "h" and not curve.get("thresholds"):
        raise UserError(f"{path} was made without a head and has no thresholds; {_fix(head if isinstance(head, (str, Path)) else 'HEAD_DIR')}")
    recorded = (curve.get("head") or {}).get("weights")
    current = weights_hash(head) if need == "h" and isinstance(head, (str, Path)) else None
    if recorded and current and recorded != current:
        raise UserError(f"{path} was made for other weights than those of the head in {head} (retrained since?); "
                        f"rerun `{curve.get('command') or autotune_command(head, _data_hint(head))}`")
    return curve


def sampling_mismatch(curve: dict, temperature: float | None) -> str | None:
    """Why the curve may not describe this decode: its acceptance was replayed at a temperature on
    the other side of 0. Greedy accepts a drafted token only where it is the target's argmax,
    sampling with probability min(1, p/q): the two acceptance rates differ, and so do the best h
    and K. None where they agree or either temperature is unknown."""
    recorded = ((curve.get("data") or {}).get("sampling") or {}).get("temperature")
    if temperature is None or recorded is None or (recorded == 0) == (temperature == 0):
        return None
    mode = "greedy (temperature 0)" if temperature == 0 else f"sampled (temperature {temperature})"
    return (f"the curve replays acceptance at temperature {recorded}, but this decode is {mode}: its "
            "acceptance differs, so the pick may not be its best; pass a number, or autotune on data "
            "generated at this temperature")
