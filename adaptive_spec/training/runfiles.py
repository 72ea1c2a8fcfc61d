"""The folder of one training run: log.jsonl, checkpoints/, the exported head/ (or drafter/) and results.json."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..runs import append_jsonl, atomic_write, read_jsonl

CKPT_STATE = "trainer_state.json"  # written last into a checkpoint: a folder without it is incomplete


class RunFiles:
    """log.jsonl, checkpoints/checkpoint_N, head/ and results.json of one run (written by the main process).

    Checkpoints are accelerate's (ProjectConfiguration automatic naming: checkpoint_0, _1, ...,
    the oldest deleted past keep_checkpoints); each holds trainer_state.json with its step."""

    def __init__(self, out: Path, main: bool):
        self.out, self.main = out, main
        self.log_path, self.ckpt_root = out / "log.jsonl", out / "checkpoints"
        self.results_path = out / "results.json"

    def has_run(self) -> bool:
        return self.log_path.exists() or (self.ckpt_root.exists() and any(self.ckpt_root.iterdir()))

    def log(self, row: dict):
        if self.main:
            append_jsonl(self.log_path, row)

    def truncate_log(self, step: int):
        """Drop rows logged after `step`: a killed run may have logged past its last checkpoint."""
        if self.main and self.log_path.exists():
            rows = [r for r in read_jsonl(self.log_path) if r["step"] <= step]
            atomic_write(self.log_path, "".join(json.dumps(r) + "\n" for r in rows))

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(accelerate's iteration, folder) of the complete checkpoints, oldest first."""
        return [(n, p) for n, p in self._numbered() if (p / CKPT_STATE).is_file()]

    def _numbered(self) -> list[tuple[int, Path]]:
        if not self.ckpt_root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.ckpt_root.iterdir()
                      if (m := re.fullmatch(r"checkpoint_(\d+)", p.name)))

    def drop_incomplete(self):
        """A kill mid-save leaves a checkpoint without trainer_state.json: delete it, so that
        accelerate neither resumes from it nor refuses to save over its name."""
        if self.main:
            for _, p in self._numbered():
                if not (p / CKPT_STATE).is_file():
                    shutil.rmtree(p, ignore_errors=True)

    def last_checkpoint(self) -> str:
        """For the Ctrl-C message: the newest complete checkpoint and its step."""
        ckpts = self.checkpoints()
        if not ckpts:
            return "no checkpoint yet"
        path = ckpts[-1][1]
        step = json.loads((path / CKPT_STATE).read_text()).get("step")
        return f"last checkpoint {path} (step {step}) kept"

    def export(self, name: str, write):
        """Write the folder `name` by `write(tmp)` into a tmp folder swapped in whole, so it is always complete."""
        if not self.main:
            return
        tmp, final, old = self.out / f"{name}.tmp", self.out / name, self.out / f"{name}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
