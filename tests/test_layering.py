"""The packages' layering: no module imports a package above it, and only the Beam shells import Beam.

    fsio, tokenization               (nothing of ours)
    formats                          fsio
    model                            fsio
    output                           model, formats, fsio
    training                         model, tokenization, fsio
    transforms                       model, output, formats, fsio, tokenization
    downstream                       model, output, formats, fsio
    pipeline, benchmarks, tests      anything
"""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {
    "fsio": set(),
    "tokenization": set(),
    "formats": {"fsio"},
    "output": {"model", "formats", "fsio"},
    "model": {"fsio"},
    "training": {"model", "tokenization", "fsio"},
    "transforms": {"model", "output", "formats", "fsio", "tokenization"},
    "downstream": {"model", "output", "formats", "fsio"},
}
OURS = set(ALLOWED) | {"pipeline", "benchmarks", "tests"}
PACKAGE = "elmo_pipeline"          # the one import name (setup.py maps the folders under it)
BEAM_SHELLS = {"transforms/chain.py", "transforms/read_step.py", "transforms/tokenize_step.py",
               "transforms/embed_step.py", "transforms/write_step.py", "transforms/coders.py", "transforms/inference.py",
               "transforms/reuse_step.py",
               "pipeline/run.py", "pipeline/plan.py", "pipeline/graph.py", "pipeline/execute.py",
               "pipeline/options.py", "pipeline/validate.py", "pipeline/workers.py"}


def _modules():
    for package in sorted(OURS - {"tests", "benchmarks"}):
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    yield package, os.path.relpath(os.path.join(root, name), REPO)


def _raw_imports(path: str) -> set[str]:
    """Every module name `path` imports (absolute imports), as written; `from elmo_pipeline import model` counts as
    elmo_pipeline.model."""
    tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == PACKAGE:
                names.update(f"{PACKAGE}.{a.name}" for a in node.names)
    return names


def _imports(path: str) -> set[str]:
    """The project's modules `path` imports, by folder (elmo_pipeline.model.bilm -> model.bilm), and others as written."""
    return {n[len(PACKAGE) + 1:] if n.startswith(PACKAGE + ".") else n for n in _raw_imports(path)} - {PACKAGE}


def _python_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build", "dist")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(root, name), REPO)


def test_one_import_name():
    """Every file imports the project as elmo_pipeline.*: a bare `import model` would load a second copy of the
    module (or another distribution's `model`) once installed."""
    bare = {path: sorted(n for n in _raw_imports(path) if n.split(".")[0] in OURS - {"tests", "benchmarks"})
            for path in _python_files()}
    assert not {p: b for p, b in bare.items() if b}


def test_no_module_imports_a_package_above_it():
    """Every module of every package, checked in one pass; the message lists all offenders."""
    offenders = []
    for package, path in _modules():
        imported = {n.split(".")[0] for n in _imports(path)}
        if package in ALLOWED:
            above = (imported & OURS) - ALLOWED[package] - {package}
            if above:
                offenders.append(f"{path} imports {sorted(above)}, above its layer")
        if path not in BEAM_SHELLS and "apache_beam" in imported:
            offenders.append(f"{path} imports Beam outside the Beam shells")
    assert not offenders, "\n".join(offenders)


WRITE_PATHS = ("output", "transforms", "formats")    # every byte of an output is written by code under these


def test_no_environment_read_or_test_hook_in_the_write_paths():
    """Test faults come from a failing sink or the fixture tests/faults/sitecustomize.py, never from a hook in the
    product: no module that writes an output reads the environment or names the fault variables. All modules under
    WRITE_PATHS are checked in one pass; the message lists all offenders."""
    offenders = {}
    for path in _python_files():
        if path.split(os.sep)[0] not in WRITE_PATHS:
            continue
        source = open(os.path.join(REPO, path), encoding="utf-8").read()
        tree = ast.parse(source)
        found = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                 and ast.unparse(n) in ("os.environ", "os.getenv", "os.environb")]
        found += [name for name in ("ELMO_PIPELINE_CRASH_AT", "crash_point") if name in source]
        if found:
            offenders[path] = found
    assert offenders == {}


def test_write_then_rename_is_in_one_place():
    """Every file written whole then renamed goes through fsio.replacing() (fsio/fs.py): no other module renames."""
    renames = {}
    for path in _python_files():
        if path.split(os.sep)[0] in OURS - {"tests"} and path != os.path.join("fsio", "fs.py"):
            tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read())
            found = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and n.attr in ("replace", "rename") and ast.unparse(n.value) in ("os", "shutil")]
            if found:
                renames[path] = found
    assert renames == {}
