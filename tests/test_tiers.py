"""The fast tier (`-m "not slow"`) starts no process, server or cluster: a test whose body starts one is marked slow."""
import ast
import glob
import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
STARTS = re.compile(r"\b(subprocess\.(run|Popen|check_output|check_call)|os\.fork|multiprocessing\.|ThreadedMotoServer|"
                    r"moto_s3|run_subprocess|LocalCluster|torch\.distributed\.run)\b")


def _unmarked_tests(path: str):
    """(name, source) of each test function in `path` without the slow mark (its own or the module's pytestmark)."""
    source = open(path, encoding="utf-8").read()
    tree = ast.parse(source)
    if any(isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n.targets[0]) and "slow" in ast.unparse(n.value)
           for n in tree.body):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") \
                and not any("mark.slow" in ast.unparse(d) for d in node.decorator_list):
            yield node.name, ast.get_source_segment(source, node)


def test_tests_that_start_processes_are_marked_slow():
    """Every test module checked in one pass; the message lists all offenders."""
    offenders = [f"{os.path.basename(path)}::{name}" for path in sorted(glob.glob(os.path.join(TESTS, "test_*.py")))
                 for name, body in _unmarked_tests(path) if STARTS.search(body)]
    assert not offenders, "mark these @pytest.mark.slow:\n" + "\n".join(offenders)
