"""What the tests of eval/'s scripts share beyond the package: a script run in a fresh interpreter, to see which
heavy libraries it imported (a --report-only path rebuilds a committed report on a machine without them)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "safetensors", "llama_cpp")


def heavy_imports(script: Path, argv: list[str]) -> list[str]:
    """The HEAVY modules `python script *argv` had imported when it ended; it must end with exit status 0."""
    code = (f"import json, runpy, sys\nsys.argv = [{str(script)!r}, *{argv!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])
