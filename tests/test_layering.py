"""The packages' layering: no module imports a package above it, and only the Beam shells import Beam.

    fsio, tokenization               (nothing of ours)
    formats                          fsio
    model                            fsio
    training                         model, tokenization, fsio
    transforms, downstream           model, formats, fsio, tokenization
    pipeline, benchmarks, tests      anything
"""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {
    "fsio": set(),
    "tokenization": set(),
    "formats": {"fsio"},
    "model": {"fsio"},
    "training": {"model", "tokenization", "fsio"},
    "transforms": {"model", "formats", "fsio", "tokenization"},
    "downstream": {"model", "formats", "fsio"},
}
OURS = set(ALLOWED) | {"pipeline", "benchmarks", "tests"}
BEAM_SHELLS = {"transforms/chain.py", "transforms/read_step.py", "transforms/tokenize_step.py",
               "transforms/embed_step.py", "transforms/write_step.py", "transforms/coders.py", "transforms/inference.py",
               "pipeline/run.py", "pipeline/plan.py", "pipeline/graph.py", "pipeline/execute.py",
               "pipeline/options.py", "pipeline/validate.py"}


def _modules():
    for package in sorted(OURS - {"tests", "benchmarks"}):
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    yield package, os.path.relpath(os.path.join(root, name), REPO)


def _imports(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package,path", list(_modules()))
def test_no_module_imports_a_package_above_it(package, path):
    imported = {n.split(".")[0] for n in _imports(path)}
    if package in ALLOWED:
        above = (imported & OURS) - ALLOWED[package] - {package}
        assert not above, f"{path} imports {sorted(above)}, above its layer"
    if path not in BEAM_SHELLS:
        assert "apache_beam" not in imported, f"{path} imports Beam outside the Beam shells"
