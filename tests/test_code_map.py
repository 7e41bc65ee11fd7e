"""docs/code-map.md is what the code says (scripts/code_map.py), and every module says what it holds."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import code_map  # noqa: E402


def test_every_module_has_a_docstring():
    assert [p for p, what in code_map.modules() if not what and not p.endswith("__init__.py")] == []


@pytest.mark.slow
def test_the_map_is_current():
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "code_map.py"), "--check"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
