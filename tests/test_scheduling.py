"""docs/scheduling.md's job script, read from the page and run as it is (bash, `elmo-pipeline run`, the shipped
model) on three daily partitions into one Iceberg table (SQLite catalog): the third killed once after its
files were added to the table and rerun, the second started twice at once (the second start exits 75) and
again once finished (exit 0, nothing added). The table then holds the three partitions' sentences, ids
unique, in exactly three snapshots; the collector file parses."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from elmo_pipeline.pipeline import exits
from tests.conftest import FAULTS
from tests.resume_helpers import REPO, write_corpus

pytestmark = pytest.mark.slow
pytest.importorskip("pyiceberg")
DAYS = ("2026-11-23", "2026-11-24", "2026-11-25")
PAGE = os.path.join(REPO, "docs", "scheduling.md")


def job_script() -> str:
    """The page's ```bash block that is the job script."""
    blocks = re.findall(r"```bash\n(.*?)```", open(PAGE, encoding="utf-8").read(), re.S)
    (script,) = [b for b in blocks if "# elmo-daily.sh YYYY-MM-DD" in b]
    return script


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedule")
    for i, day in enumerate(DAYS):     # one folder per day, the date in the file name
        os.makedirs(d / "corpus" / f"dt={day}")
        write_corpus(str(d / "corpus" / f"dt={day}" / f"news-{day}.txt"), n_docs=5, seed=10 + i)
    (d / "bin").mkdir()
    script = d / "bin" / "elmo-daily.sh"
    script.write_text(job_script())
    wrapper = d / "bin" / "elmo-pipeline"      # the console script, importing this checkout's code
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m elmo_pipeline.pipeline.cli "$@"\n')
    for f in (script, wrapper):
        f.chmod(0o755)
    (d / "metrics").mkdir()
    e = dict(os.environ, PATH=f"{d / 'bin'}:{os.environ['PATH']}", PYTHONPATH=os.pathsep.join([FAULTS, REPO]), OMP_NUM_THREADS="1",
             CORPUS=str(d / "corpus"), OUT=str(d / "out"), WAREHOUSE=str(d / "warehouse"),
             METRICS_DIR=str(d / "metrics"))
    for k in ("ELMO_PIPELINE_CRASH_AT", "ELMO_PIPELINE_DELAY_AT", "ELMO_PIPELINE_HOLD_AT"):
        e.pop(k, None)
    return d, e


def daily(env, day, wait=True, **extra):
    d, e = env
    p = subprocess.Popen([str(d / "bin" / "elmo-daily.sh"), day], env=dict(e, **extra), cwd=str(d),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        p.stdout_text, p.stderr_text = p.communicate(timeout=300)
    return p


def test_three_daily_partitions_into_one_table(env):
    d, _ = env
    first = daily(env, DAYS[0])
    assert first.returncode == 0, first.stderr_text[-3000:]

    # day 2 started twice at once: the second start finds the lease held and exits 75, touching nothing
    go = d / "go"           # the first start is held at its first batch until the second start has ended
    slow = daily(env, DAYS[1], wait=False, ELMO_PIPELINE_HOLD_AT=f"embed:{go}")
    lease = d / "out" / f"dt={DAYS[1]}" / "_lease.json"
    try:
        t0 = time.time()
        while not lease.exists():
            assert time.time() - t0 < 120 and slow.poll() is None, "the first start never took its lease"
            time.sleep(0.1)
        twice = daily(env, DAYS[1])
        assert twice.returncode == exits.TEMPFAIL, twice.stderr_text[-3000:]
        assert "is held by a live run" in twice.stderr_text and "Traceback" not in twice.stderr_text
        assert slow.poll() is None, "the first start ended before the second had"
    finally:
        go.touch()                      # never a run left held, whatever failed
    _, err = slow.communicate(timeout=300)
    assert slow.returncode == 0, err[-3000:]
    again = daily(env, DAYS[1])          # a retried task on the finished partition
    assert again.returncode == 0 and "already complete" in again.stderr_text, again.stderr_text[-3000:]

    # day 3 killed just after its files were added to the table (before _SUCCESS), then rerun
    killed = daily(env, DAYS[2], ELMO_PIPELINE_CRASH_AT="registered:1")
    assert killed.returncode == -9, killed.stderr_text[-3000:]
    rerun = daily(env, DAYS[2])
    assert rerun.returncode == 0, rerun.stderr_text[-3000:]

    from pyiceberg.catalog import load_catalog
    table = load_catalog("default", uri=f"sqlite:///{d / 'warehouse'}/catalog.db").load_table("elmo.vectors")
    assert len(table.snapshots()) == 3
    manifests = [json.load(open(d / "out" / f"dt={day}" / "manifest.json")) for day in DAYS]
    ids = table.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    assert len(ids) == sum(m["counts"]["sentences"] for m in manifests) == \
        sum(m["counts"]["sentences_written"] for m in manifests)
    assert len(ids) == len(set(ids))
    assert {i.split(":")[0] for i in ids} == {str(d / "corpus" / f"dt={day}" / f"news-{day}.txt") for day in DAYS}

    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families((d / "metrics" / "elmo_pipeline.prom").read_text())}
    (status,) = fams["elmo_pipeline_exit_status"].samples
    assert status.value == 0 and status.labels["output"] == str(d / "out" / f"dt={DAYS[2]}")
    (written,) = fams["elmo_pipeline_sentences_written"].samples
    assert written.value == manifests[2]["counts"]["sentences_written"]
