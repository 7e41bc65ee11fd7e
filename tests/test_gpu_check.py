"""benchmarks.gpu_check --device cpu --quick: every step runs and the report has its shape."""
import itertools
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_check_cpu_report(tmp_path):
    from tests.conftest import shared_path
    shared_path("data", "wikitext-2", "valid.txt")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}" in proc.stdout
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["device_name"] and saved["machine"]
    steps = saved["steps"]
    assert set(steps) == {"tests", "low_precision", "model_speed", "quality", "levers", "pipeline"}
    for name, step in steps.items():
        assert step["status"] == "ok", (name, step["result"])
    assert steps["tests"]["result"]["returncode"] == 0 and steps["tests"]["result"]["passed"] > 0
    errs = steps["low_precision"]["result"]
    assert set(errs) == {"bfloat16", "float16"} and all(0 < e < 5e-2 for v in errs.values() for e in v)
    speed = steps["model_speed"]["result"]
    assert [(r["dtype"], r["max_tokens"], r["path"], r["lanes"]) for r in speed] == [
        (dt, 4096, path, lanes) for dt in ("float32", "bfloat16")
        for path, lanes in (("forward", None), ("embedder", True), ("embedder", False))]
    assert all(r["tokens_per_s"] > 0 and r["gemm_ceiling_gflops"] > 0 for r in speed)
    quality = steps["quality"]["result"]
    assert quality["returncode"] == 0 and quality["device"] == "cpu" and set(quality["tasks"]) == {"sst2", "nextword"}
    assert all(0 < e < 5e-2 for v in quality["relative_error_per_layer"].values() for e in v)
    levers = steps["levers"]["result"]
    assert [(r["dtype"], r["rows"]) for r in levers["step"]] == [("float32", 4), ("bfloat16", 4)]
    assert all(r["eager_ms_per_step"] > 0 and "graph_ms_per_step" not in r for r in levers["step"])  # graphs: CUDA
    pipe = steps["pipeline"]["result"]
    assert [(r["workers"], r["returncode"]) for r in pipe["runs"]] == [(1, 0), (2, 0)]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["gpu_busy_share"] is None for r in pipe["runs"])
    assert pipe["model_alone"]["tokens"] == pipe["runs"][0]["tokens"] and pipe["model_alone"]["tokens_per_s"] > 0
    assert all({"tokenize", "embed", "write", "run"} <= set(r["stage_seconds"]) for r in pipe["runs"])


def test_union_of_device_intervals():
    """gpu_profile's device busy time: overlapping and nested intervals count once, gaps not at all."""
    from benchmarks.gpu_profile import _union_s
    assert _union_s([]) == 0
    assert _union_s([(0, 10), (5, 15), (6, 7), (20, 30)]) == pytest.approx(25e-6)
    assert _union_s([(20, 30), (0, 10)]) == pytest.approx(20e-6)


@pytest.mark.slow
def test_gpu_profile_cpu_report(tmp_path):
    """benchmarks.gpu_profile --device cpu: each run's wall, the pageable side by side, the host's top functions."""
    from tests.conftest import shared_path
    shared_path("data", "wikitext-2", "valid.txt")
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_profile", "--device", "cpu", "--config", "tiny",
                           "--sentences", "60", "--budget", "1024", "--lanes", "on", "off", "--pageable", "--eager-cell",
                           "--top", "5",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["dtype"], r["lanes"]) for r in runs] == [(dt, lanes) for dt in ("float32", "bfloat16")
                                                        for lanes in (True, False)]
    for r in runs:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["pageable_tokens_per_s"] > 0
        assert r["eager_cell_tokens_per_s"] > 0
        assert r["device"]["device_busy_s"] == 0 and r["device"]["top_host_ops"]       # no device on a CPU
        assert len(r["host"]["top_functions"]) == 5 and all(f["own_s"] >= 0 for f in r["host"]["top_functions"])


def test_stage_seconds_from_metrics(tmp_path):
    """gpu_check's and pipeline_throughput's rows: each stage's seconds and the run's, from the run's metrics.prom."""
    from benchmarks.common import stage_seconds
    prom = tmp_path / "metrics.prom"
    prom.write_text('# HELP x\nelmo_pipeline_tokens_written_total{output="o"} 9\n'
                    'elmo_pipeline_stage_seconds{output="o",stage="embed"} 1.5\n'
                    'elmo_pipeline_stage_seconds{output="o",stage="write"} 0.25\n'
                    'elmo_pipeline_run_seconds{output="o"} 2\n')
    assert stage_seconds(str(prom)) == {"embed": 1.5, "write": 0.25, "run": 2.0}


@pytest.mark.slow
def test_the_lease_script_calls_each_benchmark_with_flags_it_takes_and_its_default_steps_fit_one_call():
    """benchmarks/gpu_lease.sh (the GPU lease in one device call) runs under a time limit per step: every step's
    command names a benchmark module and only flags (and --steps values) that module's --help lists, and the default
    steps' limits together leave the wheels' install room in a device call's 600 s."""
    r = subprocess.run(["bash", "benchmarks/gpu_lease.sh", "commands"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    steps = {line.split()[0]: (int(line.split()[1]), line.split()[2:]) for line in r.stdout.splitlines()}
    assert {"profile", "levers", "pipeline", "quality", "tests", "speed"} <= set(steps)
    assert sum(steps[s][0] for s in ("profile", "levers", "pipeline", "quality")) <= 540
    helps: dict[str, str] = {}
    for step, (_, cmd) in steps.items():
        assert cmd[:2] == ["python3", "-m"] and cmd[2].startswith("benchmarks."), (step, cmd)
        if cmd[2] not in helps:
            h = subprocess.run([sys.executable, "-m", cmd[2], "--help"], cwd=REPO, capture_output=True, text=True,
                               timeout=300)
            assert h.returncode == 0, h.stderr
            helps[cmd[2]] = " ".join(h.stdout.split())
        flags = [w for w in cmd[3:] if w.startswith("--")]
        assert all(f"{f} " in helps[cmd[2]] + " " for f in flags), (step, flags)
        if "--steps" in cmd:
            values = list(itertools.takewhile(lambda v: not v.startswith("--"), cmd[cmd.index("--steps") + 1:]))
            assert values and all(v in helps[cmd[2]] for v in values), (step, values)
