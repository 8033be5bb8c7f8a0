"""The package layout: one installed import name, one-way imports, no import circles."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The folders installed under the one import name ``headsweep``: ``headsweep/sweep``, ``headsweep/workers`` and
# ``headsweep/results`` are relative symbolic links to the top-level folders (no package-dir mapping).
ROOTS = {"headsweep": "headsweep", "sweep": "headsweep.sweep", "workers": "headsweep.workers",
         "results": "headsweep.results"}


def module_files() -> dict[str, Path]:
    """Installed module name -> source file, for every module of the repository's packages."""
    out = {}
    for folder, package in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def imports_of(module: str, path: Path, top_level_only: bool) -> set[str]:
    """Modules of ours that ``module`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    is_package = path.name == "__init__.py"
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "headsweep" or m.startswith("headsweep.")}


def test_lower_layers_never_import_the_driver():
    """``headsweep.sweep`` may import ``workers`` and ``results``; neither imports ``sweep`` (at any depth)."""
    offenders = []
    for module, path in module_files().items():
        if module.startswith(("headsweep.workers", "headsweep.results")) or module == "headsweep.errors":
            bad = sorted(m for m in imports_of(module, path, top_level_only=False) if m.startswith("headsweep.sweep"))
            offenders += [f"{module} imports {m}" for m in bad]
        if module.startswith("headsweep.results"):
            # The store reads metric facts (direction, primary test) from the metric definitions, a
            # module without torch; nothing else of the workers (models, Ray actors) belongs in a query.
            bad = sorted(m for m in imports_of(module, path, False)
                         if m.startswith("headsweep.workers") and not m.startswith("headsweep.workers.core.metrics"))
            offenders += [f"{module} imports {m}" for m in bad]
    assert not offenders, "\n".join(offenders)


def test_import_checker_sees_a_forbidden_import(tmp_path):
    """The check above can fail: a workers-side file importing the driver is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from headsweep.sweep.run.driver import Sweep\n")
    assert imports_of("headsweep.workers.bad", bad, top_level_only=False) >= {"headsweep.sweep.run.driver"}
    rel = tmp_path / "rel.py"
    rel.write_text("from ..sweep import plan\n")
    assert "headsweep.sweep.plan" in imports_of("headsweep.workers.rel", rel, top_level_only=True)


# The sub-packages of sweep/ and of workers/ in layers, lowest first: a module imports its own sub-package and those
# below it, never one above it (docs/development.md, "Layers"). A new sub-package takes its place here.
LAYERS = {
    "headsweep.sweep": ("output", "configuration", "models", "statistics", "report_parts", "cluster", "ablation",
                        "pruning", "experiments", "run", "reporting", "demo", "terminal"),
    "headsweep.workers": ("core", "hub", "data", "attention", "ablation", "memory", "families", "pruning",
                          "analyses", "actor"),
}
# The upward imports left, all inside functions or under TYPE_CHECKING (none at module level): (importer, imported).
# Each one fixed comes off this list, and no other may join it.
LATE_UPWARD = {
    ("headsweep.sweep.cluster", "headsweep.sweep.terminal"),  # a cluster job's entry point runs the CLI
    ("headsweep.sweep.configuration", "headsweep.sweep.experiments"),  # a config is assembled from the kinds'
    ("headsweep.sweep.configuration", "headsweep.sweep.run"),  # sections and checked by the screening policy
    ("headsweep.sweep.experiments", "headsweep.sweep.run"),  # the type of the Context a kind is handed
    ("headsweep.workers.core", "headsweep.workers.ablation"),  # RuntimeOptions' default AblationSpec
    ("headsweep.workers.core", "headsweep.workers.attention"),  # the family contract's AttentionReader
}


def subpackage_of(module: str) -> str | None:
    """The sub-package of ``sweep`` or ``workers`` that ``module`` belongs to (its ``__init__`` included), else None."""
    for root in LAYERS:
        if module.startswith(root + "."):
            return ".".join(module.split(".")[:3])
    return None


def subpackage_imports(top_level_only: bool) -> dict[tuple[str, str], list[str]]:
    """(importing sub-package, imported sub-package) of the same root -> the imports behind it, ``a imports b``.
    ``from headsweep.sweep.experiments import KINDS`` imports the sub-package ``experiments`` (its ``__init__``)."""
    modules = module_files()
    found: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        for target in imports_of(module, path, top_level_only):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            importer, imported = subpackage_of(module), subpackage_of(target)
            if importer and imported and importer != imported and importer.split(".")[1] == imported.split(".")[1]:
                found.setdefault((importer, imported), []).append(f"{module} imports {target}")
    return found


def layer_breaches(imports: dict[tuple[str, str], list[str]], layers: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per pair of sub-packages in ``imports`` where one imports another in a layer above it (a pair that
    imports each other always does), or one that ``layers`` does not place, with an import that shows it."""
    breaches = []
    for (importer, imported), shown in sorted(imports.items()):
        root, _, low = importer.rpartition(".")
        high = imported.rpartition(".")[2]
        order = layers.get(root, ())
        unplaced = [name for name in (low, high) if name not in order]
        if unplaced:
            breaches.append(f"{root}.{unplaced[0]} has no layer in LAYERS: place it ({shown[0]})")
        elif order.index(low) < order.index(high):
            back = " (and it imports back: a mutual pair)" if (imported, importer) in imports else ""
            breaches.append(f"{importer} imports {imported}, a layer above it{back}: {shown[0]}")
    return breaches


def test_subpackages_import_in_layers():
    """The sub-packages of sweep/ and of workers/ form the layered order of LAYERS at module level: no sub-package
    imports one above it, so no two import each other; LAYERS places every sub-package there is."""
    breaches = layer_breaches(subpackage_imports(top_level_only=True), LAYERS)
    assert not breaches, "\n".join(breaches)
    present = {name for name in map(subpackage_of, module_files()) if name}
    placed = {f"{root}.{name}" for root, names in LAYERS.items() for name in names}
    assert present == placed, (sorted(present - placed), sorted(placed - present))


def test_upward_imports_in_functions_only_shrink():
    """Counting imports inside functions and under TYPE_CHECKING too, the upward pairs are exactly LATE_UPWARD: a new
    one is refused, and one fixed must come off the list."""
    upward = {pair for pair in subpackage_imports(top_level_only=False)
              if layer_breaches({pair: ["-"]}, LAYERS)}
    assert upward == LATE_UPWARD, (f"new: {sorted(upward - LATE_UPWARD)}; "
                                   f"fixed, take off LATE_UPWARD: {sorted(LATE_UPWARD - upward)}")


def test_layer_checker_catches_a_mutual_pair():
    """The canary: a synthetic graph whose sub-packages import each other, and one with an unplaced sub-package, fed
    to the same checker, are reported."""
    layers = {"pkg": ("low", "high")}
    mutual = {("pkg.low", "pkg.high"): ["pkg.low.a imports pkg.high.b"],
              ("pkg.high", "pkg.low"): ["pkg.high.b imports pkg.low.a"]}
    assert layer_breaches(mutual, layers) == [
        "pkg.low imports pkg.high, a layer above it (and it imports back: a mutual pair): pkg.low.a imports pkg.high.b"]
    assert layer_breaches({("pkg.high", "pkg.low"): ["pkg.high.b imports pkg.low.a"]}, layers) == []
    assert layer_breaches({("pkg.new", "pkg.low"): ["pkg.new.c imports pkg.low.a"]}, layers) == [
        "pkg.new has no layer in LAYERS: place it (pkg.new.c imports pkg.low.a)"]


def test_no_import_circles():
    """No cycle among the imports, counting every import statement wherever it stands (in a function, under
    ``TYPE_CHECKING``): a cycle hidden in a function still makes import order matter and hides layering bugs."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for m in imports_of(module, path, top_level_only=False):
            # ``from pkg import name`` names a module only when that module exists.
            while m and m not in modules:
                m = m.rpartition(".")[0]
            if m and m != module and not module.startswith(m + "."):
                targets.add(m)
        graph[module] = targets
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_every_package_folder_is_installed():
    """pyproject lists every package folder (a folder left out would be missing from a wheel)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    folders = {m for m, p in module_files().items() if p.name == "__init__.py"}
    assert folders == listed
    # No package-dir mapping: the tree under headsweep/ is the package (its sub-folders are links, below).
    assert "package-dir" not in project


def test_the_package_tree_links_the_top_level_folders():
    """``headsweep/sweep``, ``headsweep/workers``, ``headsweep/results`` are relative links to the repository's
    folders, so a static tool reading ``headsweep/`` sees the same files that run, and every module imports
    from the checkout it belongs to (never another checkout's ``sweep/`` through an installed import hook)."""
    for folder in ("sweep", "workers", "results"):
        link = REPO / "headsweep" / folder
        assert link.is_symlink(), f"{link} must be a symbolic link to ../{folder}"
        assert Path(link.readlink()) == Path("..") / folder, link.readlink()
    # A workers module that imports no torch (gates.py's 2 s import, twice, would check nothing more).
    code = ("import headsweep.sweep.terminal.cli as c, headsweep.workers.core.heads as h, "
            "headsweep.results.store as s; print(c.__file__, h.__file__, s.__file__)")
    for cwd in (REPO, REPO / "tests"):
        out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                             check=True).stdout.split()
        want = [REPO / "sweep" / "terminal" / "cli.py", REPO / "workers" / "core" / "heads.py",
                REPO / "results" / "store.py"]
        assert [Path(f).resolve() for f in out] == want, out


def test_installed_distribution_has_one_top_level_name(tmp_path):
    """Installed and as a wheel, headsweep puts one import name into site-packages: ``headsweep``."""
    dist = metadata.distribution("headsweep")
    top_level = (dist.read_text("top_level.txt") or "").split()
    assert top_level == ["headsweep"], top_level
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *ROOTS):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                              if (REPO / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("headsweep-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"headsweep"}, tops
    for module in ("headsweep/sweep/run/driver.py", "headsweep/workers/actor/eval_worker.py",
                   "headsweep/results/store.py", "headsweep/errors.py"):
        assert module in names


def test_python_dash_m_headsweep():
    proc = subprocess.run([sys.executable, "-m", "headsweep", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: headsweep" in proc.stdout


def test_the_driver_imports_neither_torch_nor_scipy_stats():
    """Every ``headsweep`` command starts a driver: torch (2 s) loads in the workers, and scipy.stats (0.6 s) when a
    run's significance is computed, not in every CLI start."""
    code = ("import sys; import headsweep.sweep.terminal.cli, headsweep.sweep.run.driver, headsweep.sweep.experiments; "
            "print(sorted(m for m in ('torch', 'scipy.stats', 'transformers', 'fairseq') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_reading_commands_do_not_import_ray():
    """``runs``, ``query``, ``status``, ``report`` and ``compare`` read a store: the experiment kinds they register
    and the store's readers leave Ray (0.4 s of every such command) to the commands that run work."""
    code = ("import sys; import headsweep.sweep.terminal.cli, headsweep.sweep.experiments, headsweep.sweep.run.status, "
            "headsweep.results.query; print('ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


def import_statements(path: Path) -> str:
    """Every import statement of ``path`` (top level, in functions, under ``if``/``try``), each as written with its
    trailing comment (a ``# pyright: ignore`` stays on its line), one after another; ``__future__`` left out."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "module", None) != "__future__":
            statement = lines[node.lineno - 1 : node.end_lineno]
            statement[0] = statement[0][node.col_offset :]
            found.append("\n".join(statement))
    return "\n".join(found) + "\n"


def test_static_tools_resolve_every_import(tmp_path):
    """pyright (basedpyright, pyrightconfig.json) resolves every import of the package, the tests and the
    benchmarks without running headsweep's install: no ``headsweep.*`` import is hidden behind an import hook.

    Asked of a copy of the repository's layout (pyrightconfig.json, the package's links) whose files hold only
    their import statements: pyright resolves the same statements from the same places without type-checking the
    code around them (13 s instead of 37 s; ``make lint`` checks the code). Two imports that cannot resolve, in
    a file of the copy's tests, show that the check finds what it looks for."""
    tool = shutil.which("basedpyright")
    assert tool, "basedpyright is not installed: make install installs it with the dev extra"
    copy = tmp_path / "repo"
    for folder in ("headsweep", "sweep", "workers", "results", "tests", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO)
            if "__pycache__" in relative.parts or (folder == "headsweep" and len(relative.parts) > 2):
                continue  # headsweep/'s sub-folders are the links made below
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            (copy / relative).write_text(import_statements(path), encoding="utf-8")
    for folder in ("sweep", "workers", "results"):
        (copy / "headsweep" / folder).symlink_to(Path("..") / folder)
    shutil.copy(REPO / "pyrightconfig.json", copy)
    (copy / "tests" / "unresolved_canary.py").write_text("import headsweep.no_such_module\nimport no_such_dist_xyz\n")
    proc = subprocess.run([tool, "--outputjson"], cwd=copy, capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    unresolved = [f"{Path(d['file']).relative_to(copy)}:{d['range']['start']['line'] + 1}: {d['message']}"
                  for d in report["generalDiagnostics"] if d.get("rule") == "reportMissingImports"]
    assert report["summary"]["filesAnalyzed"] > 100, report["summary"]
    canary = [u for u in unresolved if u.startswith("tests/unresolved_canary.py:")]
    assert [u.split(":")[1] for u in canary] == ["1", "2"], unresolved
    assert unresolved == canary, "\n".join(unresolved)
