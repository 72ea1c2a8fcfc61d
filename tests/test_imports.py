"""The package's import graph has no cycles, function-level imports included.

A cycle hidden inside a function (`from .decoding import Decoder` in a method) works at run time
but ties the modules into one unit that can only be read, tested and changed together; the
decoder's extension points (adaptive_spec/decoding/interfaces.py) exist so that none is needed.
"""
import ast
from pathlib import Path

PACKAGE = "adaptive_spec"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic_import(node: ast.AST) -> ast.Call | None:
    """A call of importlib.import_module (or import_module imported by name) or of __import__."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return node if name in ("import_module", "__import__") else None


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def dynamic_imports(tree: ast.AST, me: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules a module loads by name: import_module("a.b") / __import__("a.b") with a literal
    name (a relative one, ".b", against the package= argument's __name__); and, where a call's name is not a
    literal (a table of subcommands' modules), every string constant of the module that spells a package
    module's full name, which such a table holds."""
    calls = [c for c in map(_dynamic_import, ast.walk(tree)) if c is not None]
    out, computed = set(), False
    for call in calls:
        name = _literal(call.args[0]) if call.args else None
        if name is None:
            computed = True
            continue
        if name.startswith("."):
            level = len(name) - len(name.lstrip("."))
            base = me.split(".") if is_package else me.split(".")[:-1]
            name = ".".join(base[:len(base) - (level - 1)] + ([name.lstrip(".")] if name.lstrip(".") else []))
        out.update({name} & modules)
    if computed:
        out.update(s for s in map(_literal, ast.walk(tree)) if s in modules)
    return out


def imports_of(path: Path, modules: set[str], source: str | None = None, by_name: bool = True) -> set[str]:
    """Every package module `path` (or `source` as if it were that file) imports, at any depth of its syntax
    tree, and with by_name importlib's loads by name (dynamic_imports). `from . import x` counts as importing
    the submodule x when x is one."""
    me, is_package = module_name(path), path.name == "__init__.py"
    tree = ast.parse(path.read_text() if source is None else source)
    out = dynamic_imports(tree, me, is_package, modules) if by_name else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node, me, is_package)
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            out.update(subs or ({target} & modules))
    out.discard(me)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "adaptive_spec.errors" in graph["adaptive_spec.decoding.decoder"]
    assert "adaptive_spec.backends.engines" in graph["adaptive_spec.decoding.pipeline"]
    # cli.py imports autotune inside a function only
    assert "adaptive_spec.training.autotune" in graph["adaptive_spec.cli"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_follows_importlib_and_catches_a_cycle_through_it():
    """A cycle closed by importlib (a command line loading a subcommand's module by name, which imports the
    command line back) is a cycle: a synthetic pair of modules, and the command line's real table."""
    modules = {f"{PACKAGE}.front", f"{PACKAGE}.sub.tool", f"{PACKAGE}.sub.other"}
    front = ROOT / "front.py"
    tool = ROOT / "sub" / "tool.py"
    literal = "import importlib\ndef main():\n    return importlib.import_module('adaptive_spec.sub.tool')\n"
    relative = "import importlib\ndef main():\n    return importlib.import_module('.sub.tool', __name__)\n"
    dunder = "def main():\n    return __import__('adaptive_spec.sub.tool')\n"
    table = ("from importlib import import_module\nTOOLS = {'tool': 'adaptive_spec.sub.tool'}\n"
             "def main(n):\n    return import_module(TOOLS[n])\n")
    back = "def main():\n    from .. import front\n    return front\n"
    for source in (literal, relative, dunder, table):
        graph = {f"{PACKAGE}.front": imports_of(front, modules, source),
                 f"{PACKAGE}.sub.tool": imports_of(tool, modules, back)}
        assert graph[f"{PACKAGE}.front"] == {f"{PACKAGE}.sub.tool"}, source
        assert find_cycle(graph) == [f"{PACKAGE}.front", f"{PACKAGE}.sub.tool", f"{PACKAGE}.front"]
        # the broken control: import statements alone (the check as it was) miss the edge, and the cycle
        assert find_cycle({f"{PACKAGE}.front": imports_of(front, modules, source, by_name=False),
                           f"{PACKAGE}.sub.tool": imports_of(tool, modules, back)}) is None
    assert imports_of(front, modules, "TOOLS = {'tool': 'adaptive_spec.sub.tool'}\n") == set()  # no call: a string
    # the command line loads its subcommands by name: the probe among them, which must not import it back
    graph = import_graph()
    assert "adaptive_spec.evaluation.probe" in graph["adaptive_spec.cli"]
    assert "adaptive_spec.cli" not in graph["adaptive_spec.evaluation.probe"]


def test_package_import_graph_is_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_auto_is_reached_through_its_face_alone():
    """Outside decoding/auto/, modules import auto's names from adaptive_spec.decoding.auto, never from its inner
    modules; its __init__.py is that face: a docstring and imports, defining nothing."""
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.startswith("adaptive_spec.decoding.auto")
                 for t in targets if t.startswith("adaptive_spec.decoding.auto."))
    assert not bad, bad
    face = ast.parse((ROOT / "decoding" / "auto" / "__init__.py").read_text()).body
    assert all(isinstance(n, ast.ImportFrom) for n in face[1:]) and ast.get_docstring(ast.Module(face, [])), face


def test_interfaces_is_a_leaf():
    """The stop-rule and round-owner interfaces import nothing else of the package but errors, the policy
    registry (a leaf) and the typed settings (params and typed, and the engine records they check), which import
    nothing that imports them back."""
    graph = import_graph()
    assert graph["adaptive_spec.registry"] <= {"adaptive_spec.errors"}
    assert graph["adaptive_spec.decoding.interfaces"] <= {"adaptive_spec.errors", "adaptive_spec.params",
                                                          "adaptive_spec.registry", "adaptive_spec.typed"}
    assert graph["adaptive_spec.typed"] <= {"adaptive_spec.errors", "adaptive_spec.registry"}
    # params reads only stdlib-only modules: its checks run before torch (test_the_command_lines_checks...)
    assert graph["adaptive_spec.params"] <= {"adaptive_spec.errors", "adaptive_spec.heads.curve",
                                              "adaptive_spec.heads.folder", "adaptive_spec.typed",
                                              "adaptive_spec.backends.engines", "adaptive_spec.backends.paths",
                                              "adaptive_spec.backends.presets", "adaptive_spec.registry"}
    # and the engine records read only leaves: their loaders import an engine when a pair loads
    assert graph["adaptive_spec.backends.engines"] <= {"adaptive_spec.errors", "adaptive_spec.backends.contract",
                                                       "adaptive_spec.backends.quant_names",
                                                       "adaptive_spec.backends.torch_engine",
                                                       "adaptive_spec.backends.llamacpp",
                                                       "adaptive_spec.backends.llamacpp_pair"}


# Data flows one way: prompts -> datagen -> training -> head -> decoder -> sweep -> report. The
# generation path (models and engines, heads, decoding, the typed settings) must run without the
# parts upstream of the head or downstream of the decoder: a user who only generates installs the
# core, which lacks their libraries.
GENERATION = ("adaptive_spec.setup", "adaptive_spec.backends", "adaptive_spec.decoding", "adaptive_spec.heads",
              "adaptive_spec.params", "adaptive_spec.typed", "adaptive_spec.prompts", "adaptive_spec.prompt_archives",
              "adaptive_spec.errors", "adaptive_spec.runs", "adaptive_spec.timing", "adaptive_spec.tables",
              "adaptive_spec.config", "adaptive_spec.hub")
OFFLINE = ("adaptive_spec.datagen", "adaptive_spec.training", "adaptive_spec.evaluation")


def test_the_generation_path_imports_no_datagen_training_or_evaluation():
    """An import contract over the whole graph, function-level imports included."""
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith(GENERATION)
                 for t in targets if t.startswith(OFFLINE))
    assert not bad, bad
    assert any(m.startswith("adaptive_spec.decoding.") for m in graph)  # the prefixes name real modules


# the command-line ends of the package (and their parser, cli_args.py): they print; errors.py is the one handler every main()
# ends in and the log handler; fetch.py's main prints machine-readable paths on stdout; llama_build.py
# is make setup's script, run before the package's dependencies (and so its log handler) exist
PRINTING = {"cli.py", "cli_args.py", "evaluation/sweep.py", "evaluation/sweep_files.py", "evaluation/report.py",
            "errors.py", "setup/fetch.py", "training/train.py", "setup/llama_build.py", "evaluation/summary.py",
            "evaluation/probe.py",
            "evaluation/round_profile.py"}  # its --first-token child prints its one result line to the parent


def test_library_code_reports_through_logging():
    """Notices and warnings go through logging (errors.get_logger), so a script can quiet or route them;
    print() is left to the command-line modules, and there to their main() paths."""
    root = Path(__file__).resolve().parents[1] / "adaptive_spec"
    found = []
    for f in sorted(root.rglob("*.py")):
        if f.relative_to(root).as_posix() in PRINTING:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                found.append(f"{f.name}:{node.lineno}")
    assert not found, found


def test_no_lower_layer_imports_a_higher_one():
    """Layers, lowest first: what set-up puts on the machine (setup/) and the engines (backends/), the heads and the typed settings (params), the decoder
    (decoding/, with auto/ in it, which times and prices it), then what runs it (datagen/, training/, evaluation/). A module imports only from its own
    layer or below: the curve format lives with the heads, the logits' processing with the engines."""
    graph = import_graph()

    def layer(m: str) -> int:
        for i, prefixes in enumerate((("adaptive_spec.setup", "adaptive_spec.backends", "adaptive_spec.errors",
                                       "adaptive_spec.runs", "adaptive_spec.timing", "adaptive_spec.tables",
                                       "adaptive_spec.prompts", "adaptive_spec.prompt_archives", "adaptive_spec.hub"),
                                      ("adaptive_spec.heads", "adaptive_spec.params", "adaptive_spec.typed",
                                       "adaptive_spec.config",
                                       "adaptive_spec.registry", "adaptive_spec.drafter"),
                                      ("adaptive_spec.decoding",))):
            if m.startswith(prefixes):
                return i
        return 3

    bad = [(m, n) for m, ns in graph.items() for n in ns if layer(m) < 3 and layer(n) > layer(m)]
    assert bad == [], bad


def test_eval_scripts_import_the_package_not_tests_or_paths():
    """eval/ is thin scripts over the installed package: no sys.path edits, nothing from tests/, and no script
    importing another (what two scripts share lives in the package, e.g. evaluation/forward_costs.py)."""
    root = Path(__file__).resolve().parent.parent
    scripts = sorted((root / "eval").glob("*.py"))
    siblings = tuple(p for f in scripts for p in (f"from {f.stem} ", f"import {f.stem}"))
    bad = []
    for f in scripts:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            s = line.strip()
            if "sys.path" in s or "spec_from_file_location" in s or s.startswith(
                    ("from tiny ", "import tiny", "from tests", "import tests", *siblings)):
                bad.append(f"{f.name}:{i}: {s}")
    assert bad == [], bad


def test_the_command_lines_checks_refuse_before_torch_loads():
    """A policy/engine mismatch, a misspelled setting and a bound read from the draft's config.json are
    each refused with one error: line, and none of them imports torch or transformers (nor downloads)."""
    import subprocess
    import sys

    code = """
import sys
from adaptive_spec import cli
for argv in (["--backend", "llama.cpp", "--policy", "tree"], ["--policy", "learned", "--treshold", "0.3"],
             ["--policy", "fixed", "--k", "0"], ["--policy", "fixed", "--draft-vocab", "-3"]):
    try:
        cli.main(["generate", "--prompt", "hi", *argv])
    except SystemExit as e:
        assert e.code == 2, e.code
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 4 and all(e.startswith("error: ") for e in errors), errors



def _newer_grammar(tree: ast.AST) -> list[tuple[int, str]]:
    """Constructs of Python 3.11+ grammar that 3.10 refuses and ast.parse(feature_version=(3, 10)) lets
    through: unpacking in a subscript (`Literal[..., *names]`, PEP 646) and `except*` (PEP 654)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            found += [(node.lineno, "unpacking in a subscript") for p in parts if isinstance(p, ast.Starred)]
        elif type(node).__name__ == "TryStar":
            found.append((node.lineno, "except*"))
    return found


def test_every_module_parses_under_the_oldest_supported_python():
    """pyproject promises Python >= 3.10: every file must parse under 3.10's grammar, whatever Python runs the
    suite (ast's feature_version checks most of it, _newer_grammar what it misses); where a python3.10 is
    installed, it compiles every file too."""
    import re
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    oldest = re.search(r'requires-python = ">=3\.(\d+)"', (root / "pyproject.toml").read_text())
    assert oldest and oldest.group(1) == "10", "pyproject.toml's requires-python changed: update this test"
    files = sorted([*root.glob("adaptive_spec/**/*.py"), *root.glob("eval/*.py"), *root.glob("tests/*.py"),
                    root / "train.py"])
    bad = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(), filename=str(f), feature_version=(3, 10))
        except SyntaxError as e:
            bad.append(f"{f.relative_to(root)}:{e.lineno}: {e.msg}")
            continue
        bad += [f"{f.relative_to(root)}:{line}: {what}" for line, what in _newer_grammar(tree)]
    assert not bad, bad
    assert _newer_grammar(ast.parse("x: Literal['a', *names]")), "the check must see what 3.10 refuses"
    # a real interpreter, not pyenv's shim (which answers "command not found" for a version not selected)
    py310 = next(iter(Path.home().glob(".pyenv/versions/3.10*/bin/python3.10")), None) or (
        shutil.which("python3.10") if "shims" not in (shutil.which("python3.10") or "shims") else None)
    if py310:
        code = "import sys\nfor f in sys.argv[1:]: compile(open(f).read(), f, 'exec')"
        r = subprocess.run([str(py310), "-c", code, *map(str, files)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
