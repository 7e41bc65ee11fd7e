"""model/kernels.py: the record of what computes the vectors (LSTM loop, CPU kernel class, versions, math modes,
dtypes, row rule), kernel_difference between two records; the manifest's `kernel_path`; a --batch-invariant
worker on another path refused (ModelSpec.check_kernel_path); --reuse of a source computed on another path refused
unless --reuse-across-kernels (pipeline/reuse_sources.py kernel_note)."""
import copy
import json
import os
import subprocess
import sys

import pytest

from elmo_pipeline.model.kernels import exact_here, kernel_difference, kernel_path
from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv, read_output
from tests.conftest import shared_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_record_is_json_and_names_the_loop_the_environment_picks(monkeypatch):
    """ELMO_LSTM_GEMM is read when the record is made (as BiLM reads it when built): the loop follows it."""
    monkeypatch.delenv("ELMO_LSTM_GEMM", raising=False)
    auto = kernel_path("float32", "cpu")
    assert json.loads(json.dumps(auto)) == auto
    assert auto["device"] == "cpu" and auto["dtypes"] == {"compute": "float32", "output": "float32"}
    assert auto["versions"]["torch"] and auto["cpu"]["torch_capability"] and auto["row_rule"] is None
    monkeypatch.setenv("ELMO_LSTM_GEMM", "bmm")
    bmm = kernel_path("float32", "cpu")
    assert bmm["lstm_loop"] == ["bmm"]
    monkeypatch.setenv("ELMO_LSTM_GEMM", "onednn")
    onednn = kernel_path("float32", "cpu")
    assert onednn["lstm_loop"] == ["onednn"] and kernel_difference(onednn, bmm) == "LSTM loop onednn vs bmm"


def test_the_loop_is_chosen_per_layer_shape_as_the_model_runs_it(tiny_model_files, monkeypatch):
    """With a model, the record has the loop of each LSTM depth as model.lstm.step_loop picks it: the tiny model's
    narrow layers take bmm under 'auto'; the model's own loop option wins over the environment. Without a model
    (a launcher that does not build one), its options' shapes give the record a model built here would."""
    from elmo_pipeline.model.options import load_options
    from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
    from elmo_pipeline.model.weights import load_bilm
    monkeypatch.delenv("ELMO_LSTM_GEMM", raising=False)
    bilm = load_bilm(*tiny_model_files)
    assert kernel_path("float32", "cpu", model=bilm)["lstm_loop"] == ["bmm"] * len(bilm.forward_layers)
    assert kernel_path("float32", "cpu", model=bilm) == kernel_path("float32", "cpu",
                                                                  opts=load_options(tiny_model_files[0]))
    shipped = model_files(DEFAULT_MODEL)
    assert kernel_path("float32", "cpu", model=load_bilm(*shipped[:2])) == \
        kernel_path("float32", "cpu", opts=load_options(shipped[0]))
    bilm.lstm_loop = "onednn"
    monkeypatch.setenv("ELMO_LSTM_GEMM", "bmm")
    assert set(kernel_path("float32", "cpu", model=bilm)["lstm_loop"]) == {"onednn"}


def test_dtypes_threads_and_the_row_rule_are_recorded():
    a = kernel_path("float32", "cpu", "float16", batch_invariant=True, torch_threads=3)
    assert a["dtypes"] == {"compute": "float32", "output": "float16"} and a["torch_threads"] == 3
    assert a["row_rule"] == {"row_tile": 4}
    b = kernel_path("bfloat16", "cpu", "float16", batch_invariant=True, torch_threads=3)
    assert kernel_difference(a, b).startswith("dtypes compute float32 vs bfloat16")
    assert kernel_difference(a, dict(a, torch_threads=1)) == "torch threads 3 vs 1"
    assert kernel_difference(a, dict(a, row_rule=None)) == "batch-invariant row rule row_tile=4 vs none"


def test_kernel_difference_names_the_first_field_and_counts_the_others():
    a = kernel_path("float32", "cpu")
    assert kernel_difference(a, copy.deepcopy(a)) is None
    b = copy.deepcopy(a)
    b["cpu"]["name"] = "another SKU of the same core"          # informational: not compared
    assert kernel_difference(a, b) is None
    b["math"]["onednn_fpmath_mode"], b["versions"]["onednn"] = "bf16", "9.9.9"
    assert kernel_difference(a, b) == "ONEDNN_DEFAULT_FPMATH_MODE strict vs bf16 (and 1 other field)"
    c = copy.deepcopy(a)
    c["cpu"]["onednn_max_cpu_isa"] = "AVX2"
    assert kernel_difference(a, c) == "ONEDNN_MAX_CPU_ISA none vs AVX2"
    d = copy.deepcopy(a)
    del d["versions"]["mkl"]                                   # a field one record lacks is a difference
    assert kernel_difference(a, d).startswith("versions mkl ")
    gpu = dict(copy.deepcopy(a), device="cuda", cpu=None, gpu={"name": "NVIDIA H200", "capability": "9.0"})
    assert kernel_difference(a, gpu).startswith("device cpu vs cuda (and ")


def test_exact_wherever_the_row_rule_is_checked():
    """--dedupe's `exact`: batch-invariant on a CPU, whatever its kind, ISA cap or math mode (every GEMM is called
    only on row counts its per-process check kept: model/row_tile.py RowRule); not without batch invariance, nor on another
    device; unknown kernel path (remote: each worker checks): as batch_invariant."""
    a = kernel_path("float32", "cpu", batch_invariant=True)
    assert exact_here(a, True) and not exact_here(a, False)
    assert exact_here(None, True) and not exact_here(None, False)
    capped, bf16 = copy.deepcopy(a), copy.deepcopy(a)
    capped["cpu"]["onednn_max_cpu_isa"] = "AVX2"
    bf16["math"]["onednn_fpmath_mode"] = "bf16"
    assert exact_here(capped, True) and exact_here(bf16, True)
    assert not exact_here(dict(a, device="cuda", cpu=None), True)


def record_in_subprocess(**env) -> dict:
    """kernel_path('float32', 'cpu') of a fresh process with `env` set before torch and oneDNN load, at this
    process's torch thread count (which the record names too)."""
    import torch
    code = (f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); "
            "from elmo_pipeline.model.kernels import kernel_path; print(json.dumps(kernel_path('float32', 'cpu')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow       # fresh processes
def test_the_record_changes_with_onednn_math_mode_and_isa_cap(monkeypatch):
    """Set before the process starts (oneDNN reads them once): ONEDNN_DEFAULT_FPMATH_MODE=BF16 and
    ONEDNN_MAX_CPU_ISA=AVX2 each give another record, named by kernel_difference; ALL is no cap."""
    for name in ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    here = kernel_path("float32", "cpu")
    assert kernel_difference(here, record_in_subprocess()) is None
    assert kernel_difference(here, record_in_subprocess(ONEDNN_DEFAULT_FPMATH_MODE="BF16")) == \
        "ONEDNN_DEFAULT_FPMATH_MODE strict vs bf16"
    assert kernel_difference(here, record_in_subprocess(ONEDNN_MAX_CPU_ISA="AVX2")) == "ONEDNN_MAX_CPU_ISA none vs AVX2"
    assert kernel_difference(here, record_in_subprocess(ONEDNN_MAX_CPU_ISA="all")) is None


def test_a_batch_invariant_worker_on_another_kernel_path_is_refused(tiny_model_files):
    """load_embedder (each pipeline worker) checks its own record against the planned one where the run promises
    exact bits (--batch-invariant): one error naming the difference, never other bits under the same key."""
    import dataclasses

    from elmo_pipeline.model.kernels import planned_kernel_path
    from elmo_pipeline.model.resolve import ModelSpec
    from elmo_pipeline.model.weights import load_bilm
    from elmo_pipeline.transforms.embed import load_embedder
    spec = dataclasses.replace(ModelSpec(*tiny_model_files), batch_invariant=True, torch_threads=1).pinned()
    planned = planned_kernel_path(spec, load_bilm(*tiny_model_files), local=True)
    assert planned_kernel_path(spec, None, local=False) is None
    ok = dataclasses.replace(spec, kernel_path=planned)
    assert ok.key_prefix == spec.key_prefix and ok == spec          # not part of the identity
    assert load_embedder(ok).model is not None
    other = copy.deepcopy(planned)
    other["lstm_loop"] = ["onednn"] * len(other["lstm_loop"])
    with pytest.raises(ValueError, match=r"another kernel path than the run was planned with \(planned vs here: "
                                         r"LSTM loop onednn/onednn vs bmm/bmm\)"):
        load_embedder(dataclasses.replace(spec, kernel_path=other))
    assert load_embedder(dataclasses.replace(spec, kernel_path=other, batch_invariant=False)).model is not None


def test_a_source_record_against_this_runs(caplog):
    """pipeline/reuse_sources.py kernel_note: the same path; none recorded (an older output: reused, warned); this run's
    unknown (a remote runner); another or a damaged record: refused unless --reuse-across-kernels, then noted."""
    from elmo_pipeline.pipeline.reuse_sources import Kernels, kernel_note
    from elmo_pipeline.transforms.reuse import ForeignSourceError, KernelPathError
    here = kernel_path("float32", "cpu")
    other = dict(copy.deepcopy(here), lstm_loop=["bmm", "bmm"])
    assert kernel_note([copy.deepcopy(here)], "src", "--reuse", Kernels(here)) == "same"
    assert kernel_note([other], "src", "--reuse", Kernels(None)) == "not compared"
    assert kernel_note([other], "src", "--reuse", None) == "not compared"
    assert kernel_note(None, "src", "--reuse", Kernels(here)) == "not recorded"
    assert "--reuse src: its manifest records no kernel path" in caplog.text
    with pytest.raises(KernelPathError, match=r"^--reuse src: computed on another kernel path \(LSTM loop bmm/bmm vs "):
        kernel_note([other], "src", "--reuse", Kernels(here))
    with pytest.raises(ForeignSourceError, match=r"\(a damaged kernel_path record, source vs this run\)"):
        kernel_note("bmm", "src", "--reuse", Kernels(here))
    assert kernel_note([other], "src", "--reuse", Kernels(here, across=True)).startswith(
        "differs: LSTM loop bmm/bmm vs ") and "(--reuse-across-kernels)" in \
        kernel_note([other], "src", "--reuse", Kernels(here, across=True))
    with pytest.raises(KernelPathError, match=r"\(its workers computed on 2 kernel paths; LSTM loop bmm/bmm vs "):
        kernel_note([here, other], "src", "--reuse", Kernels(here))
    deep = {}
    for _ in range(900):                                  # nested past the recursion limit of a comparison
        deep = {"cpu": deep}
    for damaged in ([], [here, "bmm"], here, [deep], [dict(here, cpu=deep)]):
        with pytest.raises(ForeignSourceError, match=r"\(a damaged kernel_path record, source vs this run\)"):
            kernel_note(damaged, "src", "--reuse", Kernels(here))


def test_the_manifest_names_the_kernel_paths_its_shards_were_computed_on():
    """output/manifest.py with_kernel_paths, from the shards' commit records: the workers' one path (a remote run's,
    planned as null, too); several: null, the list, and --dedupe not exact; a shard of an earlier version counts as
    planned (null on a remote run: not recorded); nothing embedded: as planned; exact is never raised."""
    from elmo_pipeline.formats.layout import ShardInfo, recorded_kernel_paths
    from elmo_pipeline.output.manifest import with_kernel_paths
    here = kernel_path("float32", "cpu", batch_invariant=True)
    other = dict(copy.deepcopy(here), lstm_loop=["bmm", "bmm"])
    gpu = dict(copy.deepcopy(here), device="cuda")

    def shard(*kernels):                # shard(None): a commit record of an earlier version (no kernel_paths)
        return ShardInfo({}, 1, 1, "a", {} if kernels == (None,) else {"kernel_paths": list(kernels)})

    def completed(planned, *shards, exact=True):
        m = {"kernel_path": planned, "dedupe": {"scope": "run", "exact": exact}}
        with_kernel_paths(m, list(shards))
        return m
    m = completed(None, shard(here), shard(copy.deepcopy(here)))
    assert m["kernel_path"] == here and "worker_kernel_paths" not in m and m["dedupe"]["exact"] is True
    assert recorded_kernel_paths(m) == [here]
    m = completed(None, shard(here), shard(other))
    assert m["kernel_path"] is None and m["dedupe"]["exact"] is False
    assert sorted(p["lstm_loop"][0] for p in m["worker_kernel_paths"]) == ["bmm", here["lstm_loop"][0]]
    assert recorded_kernel_paths(m) == m["worker_kernel_paths"]
    assert completed(here, shard(None), shard(here))["kernel_path"] == here
    assert completed(here, shard(None), shard(other))["kernel_path"] is None
    m = completed(None, shard(None), shard(here))
    assert m["kernel_path"] is None and "worker_kernel_paths" not in m and recorded_kernel_paths(m) is None
    assert completed(here, shard())["kernel_path"] == here and completed(None)["kernel_path"] is None
    assert completed(here, shard(other))["kernel_path"] == other          # what the workers computed on wins
    assert completed(None, shard(gpu))["dedupe"]["exact"] is False
    assert completed(None, shard(here), exact=False)["dedupe"]["exact"] is False
    sku = copy.deepcopy(here)
    sku["cpu"]["name"] = "another SKU of the same core"   # recorded, not compared: one path
    m = completed(None, shard(here), shard(sku))
    assert kernel_difference(here, sku) is None and m["kernel_path"] in (here, sku) and m["dedupe"]["exact"] is True
    m = completed(None, shard(None), shard(here), shard(other))   # two paths known, a shard unknown
    assert m["kernel_path"] is None and "worker_kernel_paths" not in m and m["dedupe"]["exact"] is False
    deep = {}
    for _ in range(900):
        deep = {"x": deep}
    m = completed(None, shard(deep), shard(here))                 # a damaged record: that shard's path unknown
    assert m["kernel_path"] is None and "worker_kernel_paths" not in m
    assert completed(here, shard(dict(here, cpu=deep)))["kernel_path"] == here    # local: counted as planned


def test_an_upsert_records_the_paths_of_the_rows_it_keeps():
    """formats/iceberg/upsert.py Upsert.kernel_paths_after: this run's paths where it keeps no row of another run's
    or keeps rows of its own path; else the kept rows' paths as well, each once; none when theirs are not recorded
    or damaged (a remote run, 'not compared', never passes the table's older rows off as its own path's)."""
    from elmo_pipeline.formats.iceberg.upsert import Upsert
    here = kernel_path("float32", "cpu")
    other = dict(copy.deepcopy(here), lstm_loop=["bmm", "bmm"])
    manifest = {"kernel_path": here}

    def after(state, note, table):
        return Upsert(None, 1 if state else None, state, kernel_path=table, kernel_note=note).kernel_paths_after(
            manifest)
    assert after({}, "not compared", None) == [here]                              # the first day
    assert after({"d": "h"}, "same", [here]) == [here]
    both = after({"d": "h"}, "not compared", [other])                             # a remote day
    assert len(both) == 2 and {json.dumps(k, sort_keys=True) for k in both} == {
        json.dumps(k, sort_keys=True) for k in (here, other)}
    assert len(after({"d": "h"}, "differs: LSTM loop (--reuse-across-kernels)", [other, here])) == 2
    assert after({"d": "h"}, "not recorded", None) is None
    assert after({"d": "h"}, "differs: a damaged kernel_path record", ["bmm"]) is None
    assert after({"d": "h"}, "not compared", [here]) == [here]


def test_json_nested_past_the_parser_is_damaged_not_a_crash():
    """fsio json_or_none and formats.layout.checked_record (staged records, manifests, table properties): a JSON
    value nested deeper than the parser recurses reads as not JSON / no whole record."""
    from elmo_pipeline.formats.layout import checked_record
    from elmo_pipeline.fsio import json_or_none
    deep = b"[" * 100_000 + b"]" * 100_000
    assert json_or_none(deep) is None and checked_record(deep) is None
    assert checked_record(b'{"files": {}, "sentences": 0, "tokens": 0, "first_id": "", "x": ' + deep + b"}") is None


def test_a_commit_record_keeps_the_kernel_paths_of_its_embedded_sentences(tmp_path):
    """output/staging.py Staging.shard: the distinct kernel paths of the shard's embedded batches in its commit record,
    read back by ShardInfo.from_record; [] when every sentence was reused; left out when a batch names none; a
    damaged list is read as not recorded."""
    import numpy as np

    from elmo_pipeline.formats.layout import ShardInfo
    from elmo_pipeline.output.staging import ShardSpec, Staging
    from elmo_pipeline.transforms.records import EmbeddedBatch, Item
    here = kernel_path("float32", "cpu")
    spec = ShardSpec(("parquet",), "sentence", (("layer_0", 2),), (0,), False, "float32", 1 << 20, 1, 4)

    def staged(*batches):
        st = str(tmp_path / f"st{len(os.listdir(tmp_path))}")
        info = Staging(st).shard([(b, 0) for b in batches], spec)
        name = os.path.basename(info.files["parquet"]).split(".")[0]
        record = json.load(open(os.path.join(st, "committed", name + ".json")))
        assert ShardInfo.from_record(record, st).extra.get("kernel_paths") == record.get("kernel_paths")
        return record

    def batch(i, **kw):
        return EmbeddedBatch([Item(f"d:{i}#0", f"d:{i}", 0, ("a",), ((0, 1),))], np.ones((1, 1, 4), np.float32),
                             np.array([0, 1]), **kw)
    kernel = json.dumps(here, sort_keys=True)
    assert staged(batch(1, kernel=kernel), batch(2, kernel=kernel))["kernel_paths"] == [here]
    assert staged(batch(1, kernel=kernel), batch(2, source="s3://b/day1"))["kernel_paths"] == [here]
    assert staged(batch(1, source="s3://b/day1"))["kernel_paths"] == []
    assert "kernel_paths" not in staged(batch(1, kernel=kernel), batch(2))
    damaged = {"files": {}, "sentences": 0, "tokens": 0, "first_id": "", "kernel_paths": ["onednn"]}
    assert "kernel_paths" not in ShardInfo.from_record(damaged, str(tmp_path)).extra


# -- whole runs --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("kp")
    with open(shared_path("data", "wikitext-2", "valid.txt"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    (d / "day.txt").write_text("".join(lines))
    return str(d / "day.txt")


def run(model_files, inp, out, *extra):
    return main(argv(model_files, inp, out, "--batch-invariant", *extra))


@pytest.mark.slow
def test_reuse_across_a_kernel_path_is_refused_unless_asked(corpus, tiny_model_files, tmp_path, capsys, monkeypatch):
    """Day 1 with ELMO_LSTM_GEMM=onednn (another LSTM loop: other bits under the same key prefix), day 2 with the
    defaults and --reuse day 1: exit 2, one error line naming the difference and the flag, nothing written; with
    --reuse-across-kernels: reused, and the manifest says from which kernel path."""
    monkeypatch.setenv("ELMO_LSTM_GEMM", "onednn")
    day1 = str(tmp_path / "day1")
    assert run(tiny_model_files, corpus, day1) == 0
    monkeypatch.delenv("ELMO_LSTM_GEMM")
    capsys.readouterr()
    out = str(tmp_path / "r")
    assert run(tiny_model_files, corpus, out, "--reuse", day1) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([e for e in err if e.startswith("error:")]) == 1
    assert err[-1].startswith(f"error: --reuse {day1}: computed on another kernel path (LSTM loop onednn/onednn vs "
                              "bmm/bmm, source vs this run)") and "--reuse-across-kernels" in err[-1], err[-1]
    assert not os.path.exists(out)
    assert run(tiny_model_files, corpus, out, "--reuse", day1, "--reuse-across-kernels") == 0
    m = read_output(out)[0]
    assert m["reuse"]["kernel_paths"] == ["differs: LSTM loop onednn/onednn vs bmm/bmm (--reuse-across-kernels)"]
    assert m["counts"]["sentences_reused"] == m["counts"]["sentences_written"] > 0
    assert m["kernel_path"]["lstm_loop"] == ["bmm", "bmm"]
    assert json.load(open(f"{day1}/manifest.json"))["kernel_path"]["lstm_loop"] == ["onednn", "onednn"]


@pytest.mark.slow
def test_a_source_manifest_with_another_or_no_record(corpus, tiny_model_files, tmp_path, capsys, caplog):
    """The source's manifest rewritten (manifests are not digest-checked; its files' records stay valid): another
    math mode is refused; no record (an output of an earlier version) is reused with a warning, recorded as such;
    the same record is recorded 'same'."""
    from elmo_pipeline.model.weights import load_bilm
    src = str(tmp_path / "src")
    assert run(tiny_model_files, corpus, src) == 0
    m = json.load(open(f"{src}/manifest.json"))
    assert m["kernel_path"] == kernel_path("float32", "cpu", batch_invariant=True, torch_threads=1,
                                           model=load_bilm(*tiny_model_files))
    same = str(tmp_path / "same")
    assert run(tiny_model_files, corpus, same, "--reuse", src) == 0
    assert read_output(same)[0]["reuse"]["kernel_paths"] == ["same"]
    bf16 = copy.deepcopy(m)
    bf16["kernel_path"]["math"]["onednn_fpmath_mode"] = "bf16"
    open(f"{src}/manifest.json", "w").write(json.dumps(bf16))
    capsys.readouterr()
    assert run(tiny_model_files, corpus, str(tmp_path / "r"), "--reuse", src) == 2
    assert "(ONEDNN_DEFAULT_FPMATH_MODE bf16 vs strict, source vs this run)" in capsys.readouterr().err
    del bf16["kernel_path"]
    open(f"{src}/manifest.json", "w").write(json.dumps(bf16))
    old = str(tmp_path / "old")
    assert run(tiny_model_files, corpus, old, "--reuse", src) == 0
    assert "its manifest records no kernel path (an output of an earlier version)" in caplog.text
    assert read_output(old)[0]["reuse"]["kernel_paths"] == ["not recorded"]


def test_a_commit_records_ids_that_inflate_past_the_bound_or_are_cut_short_are_damaged(monkeypatch):
    """formats/layout.py record_ids: "ids_zlib" inflates to at most MAX_IDS_BYTES (here 1,000) and never further
    (a zlib bomb of 64 MiB in a record of a few hundred bytes), and a stream cut short is no whole record."""
    import base64
    import json as json_
    import zlib

    from elmo_pipeline.formats import layout
    from elmo_pipeline.formats.layout import checked_record
    monkeypatch.setattr(layout, "MAX_IDS_BYTES", 1000)

    def record(ids_zlib: bytes) -> bytes:
        return json_.dumps({"files": {}, "sentences": 2, "tokens": 4, "first_id": "a",
                            "ids_zlib": base64.b64encode(ids_zlib).decode()}).encode()

    whole = zlib.compress(json_.dumps(["a", "b"]).encode())
    assert checked_record(record(whole))[1] == ["a", "b"]
    assert checked_record(record(whole[:-3])) is None
    bomb = zlib.compress(b'["' + b"a" * (64 << 20) + b'", "b"]', 9)
    assert len(bomb) < 100_000 and checked_record(record(bomb)) is None
