"""The import graph of the package's modules, benchmarks and scripts has no circle (every import counted, lazy
ones too; `from package import submodule` is an edge to the submodule)."""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("fsio", "tokenization", "formats", "model", "output", "training", "transforms", "downstream", "pipeline",
           "benchmarks", "scripts")
PACKAGE = "elmo_pipeline."


def modules() -> dict[str, str]:
    """{dotted name as the package imports it (no elmo_pipeline. prefix): path}."""
    out = {}
    for folder in FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, name), REPO)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(root, name)
    return out


def edges(path: str, mods: dict) -> set[str]:
    def known(name: str) -> str:
        name = name.removeprefix(PACKAGE)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module.removeprefix(PACKAGE)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base) for a in node.names)
    return found - {""}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_no_import_circle():
    mods = modules()
    graph = {m: edges(p, mods) - {m} for m, p in mods.items()}
    assert circles(graph) == []


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
