"""Packaging: the base install stays lean (no optional package in install_requires, none imported by the
pipeline until a flag asks for it) and every optional extra installs from the versions pinned in
constraints.txt (`pip install -c constraints.txt -e '.[iceberg]'`, likewise s3, downstream, dask, test)."""
import ast
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = {"pyiceberg", "sqlalchemy", "s3fs", "boto3", "datasets", "matplotlib", "dask", "distributed", "duckdb",
            "moto", "pytest", "prometheus_client"}


def _setup_kwargs() -> dict:
    tree = ast.parse(open(os.path.join(REPO, "setup.py"), encoding="utf-8").read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement ('pyiceberg[sql-sqlite]>=0.12' -> 'pyiceberg')."""
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in open(os.path.join(REPO, "constraints.txt"), encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_base_install_has_no_optional_package():
    base = {_name(r) for r in _setup_kwargs()["install_requires"]}
    assert not base & OPTIONAL, sorted(base & OPTIONAL)


@pytest.mark.parametrize("extra", ["iceberg", "s3", "downstream", "dask", "test"])
def test_every_package_of_an_extra_is_pinned(extra):
    extras, pins = _setup_kwargs()["extras_require"], _pins()
    unpinned = [r for r in extras[extra] if _name(r) not in pins]
    assert not unpinned, f"[{extra}]: {unpinned} not pinned in constraints.txt"


def test_iceberg_extra_pins_pyiceberg_and_its_sql_catalog():
    pins = _pins()
    assert {"pyiceberg", "sqlalchemy", "pydantic", "pyroaring", "mmh3", "strictyaml", "tenacity", "cachetools",
            "rich"} <= set(pins)
    assert "iceberg" in _setup_kwargs()["extras_require"]
    assert any(_name(r) == "pyiceberg" for r in _setup_kwargs()["extras_require"]["test"])


@pytest.mark.slow
def test_the_pipeline_imports_no_optional_package_until_asked():
    lazy = sorted(OPTIONAL - {"boto3"})        # Beam itself imports boto3 when it is installed (its S3 I/O)
    code = ("import sys, pipeline.run, pipeline.cli, formats.iceberg, output.finalize; "
            f"print(sorted(m for m in {lazy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
