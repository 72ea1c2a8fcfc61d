"""eval/bench_revisions.py: the same decodes under two revisions, interleaved, on tiny models."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_revisions_tiny_and_report_only(tmp_path):
    out = tmp_path / "rev"
    script = str(ROOT / "eval" / "bench_revisions.py")
    run = subprocess.run([sys.executable, script, "--tiny", "--rounds", "1", "--max-new-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["config"], r["revision"]) for r in rows} == {(c, rev) for c in ("torch target alone", "torch fixed K=3")
                                                           for rev in ("base", "this")}
    assert all(0 < r["n_tokens"] <= 8 and r["decode_s"] > 0 for r in rows)
    report = (out / "report.md").read_text()
    assert "| torch fixed K=3 |" in report and "x |" in report
    again = subprocess.run([sys.executable, script, "--report-only", "--out", str(out)], capture_output=True,
                           text=True, cwd=ROOT)
    assert again.returncode == 0 and (out / "report.md").read_text() == report
    bad = subprocess.run([sys.executable, script, "--configs", "warp drive", "--out", str(out)], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "torch target alone" in bad.stderr
