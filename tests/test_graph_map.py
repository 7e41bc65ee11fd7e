"""pipeline/graph.py's docstring is the map of the steps a newcomer reads first: it names every step label the
graph has, and no label the graph does not have."""
import ast
import os
import re

GRAPH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipeline", "graph.py")
IN_ONE_STEP = {"SortAndBatch", "EmbedBatches", "WriteShards"}    # DoFns chained inside EmbedShards, not labels


def labels_in_code(tree) -> set[str]:
    """Every step label: `"Label" >> ...`, stage(..., "Label", ...), and f"{label}..." aside (derived)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.RShift) and isinstance(node.left, ast.Constant):
            found.add(node.left.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "stage":
            found.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return found


def test_the_docstring_names_exactly_the_graphs_steps():
    tree = ast.parse(open(GRAPH, encoding="utf-8").read())
    steps = ast.get_docstring(tree).split("\n\n")[1]
    named = set(re.findall(r"\b([A-Z][a-z]+(?:[A-Z][a-z]+)*)\b", steps)) - IN_ONE_STEP
    assert named == labels_in_code(tree)
