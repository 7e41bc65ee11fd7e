"""--reuse (transforms/reuse.py, pipeline/graph.py): a sentence whose key an earlier output's key index holds is
written with that output's stored vectors, not embedded; the output equals a run without --reuse bit for bit
(--batch-invariant), and the counts say how many sentences were reused, from where. Foreign, missing or damaged
earlier outputs are refused with one line."""
import json
import os
import random
import re
import shutil

import numpy as np
import pytest

from elmo_pipeline.output.staging import ShardSpec
from elmo_pipeline.pipeline.run import main
from elmo_pipeline.transforms.records import EmbeddedBatch, Item
from elmo_pipeline.transforms.reuse import (NOT_FOUND, ReuseError, bucket_of, by_shard, index_blobs, join_key,
                                            location, match, model_vectors, reused_batches, unpack)
from tests.resume_helpers import argv, read_output
from tests.test_dedupe import assert_equal_outputs
from tests.conftest import shared_path



def item(i, tokens, copies=()):
    return Item(f"d{i}#0", f"d{i}", 0, tuple(tokens), tuple((k, k + 1) for k in range(len(tokens))), copies=copies)


def test_a_location_packs_source_shard_and_row():
    loc = location(3, 70_000, 19_999)
    assert unpack(loc) == (3, 70_000, 19_999)
    assert by_shard(loc, item(1, "a")) == ((3, 70_000), (19_999, item(1, "a")))


def test_key_index_rows_are_packed_per_bucket_and_matched_exactly(tmp_path):
    """index_blobs packs a key-index file's rows per key bucket; match gives each Item the smallest location of its
    key over all packed rows (two sources here), or NOT_FOUND; a key that shares its first 8 bytes with a wanted
    one is no match."""
    from elmo_pipeline.formats.parquet import write_key_index
    from elmo_pipeline.model.resolve import sentence_key
    keys = [sentence_key("0123456789abcdef", [w]) for w in ("a", "b", "c", "a")]
    path = str(tmp_path / "k.parquet")
    with open(path, "wb") as f:
        write_key_index(["x#0", "x#1", "x#2", "x#3"], keys, f)
    blobs = {}
    for source in (1, 0):
        for b, blob in index_blobs(source, 7, path, 3):
            blobs.setdefault(b, []).append(blob)
    a, c = join_key(keys[0]), join_key(keys[2])
    near = a[:8] + bytes(8)                         # same first half, another key
    assert sum(len(v) for v in blobs.values()) == 2 * len({bucket_of(join_key(k), 3) for k in keys})
    got = match([(a, item(1, "a")), (near, item(2, "n"))], blobs[bucket_of(a, 3)])
    assert got == [(location(0, 7, 0), item(1, "a")), (NOT_FOUND, item(2, "n"))]
    assert match([(c, item(3, "c"))], blobs[bucket_of(c, 3)]) == [(location(0, 7, 2), item(3, "c"))]
    assert match([(c, item(3, "c"))], []) == [(NOT_FOUND, item(3, "c"))]
    assert match([], blobs[bucket_of(c, 3)]) == []
    with open(path, "wb") as f:
        write_key_index(["x#0"], ["not a key"], f)
    with pytest.raises(ReuseError, match="no sentence keys"):
        list(index_blobs(0, 0, path, 3))


def spec(selection, duplicate_layer0=False, dtype="float32"):
    from elmo_pipeline.formats.parquet import layer_columns
    cols = layer_columns(selection, 8, duplicate_layer0)
    return ShardSpec(("parquet", "hdf5"), "sentence", tuple(cols),
                     selection if selection == "average" else tuple(selection), duplicate_layer0, dtype, 1 << 20, 3, 8)


@pytest.mark.parametrize("selection,dup,dtype", [((0, 1, 2), False, "float32"), ((0, 1, 2), True, "float32"),
                                                 ((2,), False, "float32"), ((2, 0), False, "float16"),
                                                 ("average", False, "float32")])
def test_stored_columns_go_back_to_the_same_stored_columns_and_hdf5(selection, dup, dtype):
    """model_vectors is the inverse of ShardSpec.sources on what is stored: the columns (and the HDF5 array) built
    from it are the stored ones, bit for bit, in every layer selection and dtype."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((3, 5, 8)).astype(np.float32)
    full[0, :, 4:] = full[0, :, :4]                 # layer 0 is [x, x]
    s = spec(selection, dup, dtype)
    stored = [c.astype(dtype) for c in s.sources(full)[0]]
    h5 = s.sources(full)[1].astype(dtype)
    vectors, layers = model_vectors(stored, s.selection, s.duplicate_layer0, s.n_layers, s.dim)
    cols, h = s.sources(vectors, layers)
    assert [c.astype(dtype).tobytes() for c in cols] == [c.tobytes() for c in stored]
    assert h.astype(dtype).tobytes() == h5.tobytes()


def test_reused_batches_carry_copies_and_their_source_and_check_tokens():
    s = spec((0, 1, 2))
    found = [(4, item(1, "ab", copies=(item(7, "ab"),))), (9, item(2, "xyz"))]
    stored = [np.arange(5 * d, dtype=np.float32).reshape(5, d) for _, d in s.columns]
    out = list(reused_batches(found, [["a", "b"], ["x", "y", "z"]], stored, np.array([2, 3]), s, "src", batch=1))
    assert [b.source for b in out] == ["src", "src"] and [b.copies for b in out] == [0, 0]
    assert [[i.id for i in b.items] for b in out] == [["d1#0", "d7#0"], ["d2#0"]]
    assert out[0].items[0].copies == ()
    cols = s.sources(out[0].vectors, out[0].layers)[0]
    assert all((c[:2] == c[2:4]).all() and (c[:2] == st[:2]).all() for c, st in zip(cols, stored))
    assert [c.tobytes() for c in s.sources(out[1].vectors, out[1].layers)[0]] == [st[2:].tobytes() for st in stored]
    with pytest.raises(ReuseError, match="other tokens"):
        list(reused_batches(found, [["a", "c"], ["x", "y", "z"]], stored, np.array([2, 3]), s, "src"))


def test_a_reused_batch_goes_through_the_coders():
    from apache_beam import coders
    import elmo_pipeline.transforms.coders  # noqa: F401
    b = EmbeddedBatch([item(1, "ab")], np.ones((3, 2, 4), np.float32), np.array([0, 2]), None, 0, "s3://b/day1")
    c = coders.registry.get_coder(EmbeddedBatch)
    got = c.decode(c.encode(b))
    assert got.source == "s3://b/day1" and got.items == b.items
    assert c.decode(c.encode(EmbeddedBatch([item(1, "ab")], b.vectors, b.offsets))).source is None


# -- whole runs --------------------------------------------------------------------------------------------------

def day2(lines: list[str], seed=5):
    """`lines` with about 10 % of its documents edited (a word changed), 3 % removed and two added."""
    rng, out = random.Random(seed), []
    for line in lines:
        if line.strip() and not line.startswith(" =") and rng.random() < 0.03:
            continue
        if line.strip() and not line.startswith(" =") and rng.random() < 0.1:
            words = line.split(" ")
            k = rng.randrange(len(words))
            words[k] = "edited" if words[k].strip() else words[k]
            line = " ".join(words)
        out.append(line)
    return out + [" A new page about the harbour . Its boats stayed home . ", " Another new page . "]


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    d = tmp_path_factory.mktemp("days")
    with open(shared_path("data", "wikitext-2", "valid.txt"), encoding="utf-8") as f:
        lines = [next(f).rstrip("\n") for _ in range(240)]
    (d / "day1.txt").write_text("\n".join(lines) + "\n")
    (d / "day2.txt").write_text("\n".join(day2(lines)) + "\n")
    return str(d / "day1.txt"), str(d / "day2.txt")


def shipped(inp, out, *extra):
    return ["--input", inp, "--output", out, "--batch-invariant", "--torch-threads", "1", "--progress", "off",
            "--shard-sentences", "150", *extra]


@pytest.mark.slow
def test_day2_with_reuse_equals_a_full_day2_run(days, tmp_path, capsys):
    """Shipped model, --batch-invariant: day 2 with --reuse day 1 writes the same ids, tokens, offsets and
    vectors (Parquet and HDF5, bit for bit) as a full day-2 run; reused = day 2's sentences whose tokens day 1
    holds, the others embedded; the run key is that of the full run; counts in manifest, metrics and summary."""
    d1, d2 = days
    one, full, reuse = (str(tmp_path / n) for n in ("one", "full", "reuse"))
    assert main(shipped(d1, one)) == 0
    assert main(shipped(d2, full)) == 0
    capsys.readouterr()
    assert main(shipped(d2, reuse, "--reuse", one)) == 0
    line = capsys.readouterr().err
    got, ref, first = read_output(reuse), read_output(full), read_output(one)
    assert_equal_outputs(got, ref)
    old = {tuple(r["tokens"]) for r in first[1].values()}
    unchanged = sum(tuple(r["tokens"]) in old for r in ref[1].values())
    c = got[0]["counts"]
    assert 0 < unchanged < c["sentences_written"] and c["sentences_reused"] == unchanged
    assert c["sentences_reused_by_source"] == {one: unchanged}
    assert c["sentences_embedded"] + c["sentences_deduplicated"] + c["sentences_reused"] == c["sentences_written"]
    assert c["sentences_embedded"] <= c["sentences_written"] - unchanged
    assert got[0]["reuse"]["sources"] == [one] and got[0]["run"]["key"] == ref[0]["run"]["key"]
    assert f", {unchanged} reused)" in line
    prom = open(f"{reuse}/metrics.prom").read()
    assert f'elmo_pipeline_sentences_reused_total{{output="{reuse}"}} {unchanged}' in prom
    assert f'elmo_pipeline_sentences_reused_by_source_total{{output="{reuse}",source="{one}"}} {unchanged}' in prom


@pytest.fixture(scope="module")
def tiny_days(days, tiny_model_files, tmp_path_factory):
    """Day 1 with the tiny model, as Parquet and as Arrow, and a full day-2 run (tiny model, --batch-invariant)."""
    d = tmp_path_factory.mktemp("tiny")
    d1, d2 = days
    outs = {n: str(d / n) for n in ("parquet", "arrow", "full")}
    flags = ("--batch-invariant", "--shard-sentences", "200")
    assert main(argv(tiny_model_files, d1, outs["parquet"], *flags)) == 0
    assert main(argv(tiny_model_files, d1, outs["arrow"], *flags, "--format", "arrow,hdf5")) == 0
    assert main(argv(tiny_model_files, d2, outs["full"], *flags)) == 0
    return outs, flags


@pytest.mark.slow
def test_reuse_from_arrow_and_two_sources_without_dedupe(days, tiny_days, tiny_model_files, tmp_path):
    """An Arrow source, and two sources at once (each key taken from the first that holds it), with --dedupe off:
    the same output as the full run."""
    outs, flags = tiny_days
    got = str(tmp_path / "r")
    assert main(argv(tiny_model_files, days[1], got, *flags, "--dedupe", "off", "--reuse", outs["arrow"],
                     "--reuse", outs["parquet"])) == 0
    out, ref = read_output(got), read_output(outs["full"])
    assert_equal_outputs(out, ref)
    c = out[0]["counts"]
    assert c["sentences_reused_by_source"][outs["arrow"]] == c["sentences_reused"] > 0
    assert c["sentences_reused_by_source"][outs["parquet"]] == 0 and c["sentences_deduplicated"] == 0


def last_error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_foreign_source_never_matches(days, tiny_days, tiny_model_files, tmp_path, capsys):
    """Another model (the shipped one), another stored dtype: refused with one line naming the source and both key
    prefixes, before anything is written."""
    outs, flags = tiny_days
    out = str(tmp_path / "r")
    assert main(shipped(days[1], out, "--reuse", outs["parquet"])) == 2
    err = last_error(capsys)
    assert err.startswith(f"error: --reuse {outs['parquet']}: written by another model or other vector settings")
    assert not os.path.exists(out)
    assert main(argv(tiny_model_files, days[1], out, *flags, "--dtype", "float16", "--reuse", outs["parquet"])) == 2
    assert "written by another model or other vector settings" in last_error(capsys)


@pytest.mark.slow
def test_a_missing_or_damaged_source_is_refused(days, tiny_days, tiny_model_files, tmp_path, capsys):
    outs, flags = tiny_days
    bad = str(tmp_path / "bad")
    shutil.copytree(outs["parquet"], bad)
    run = argv(tiny_model_files, days[1], str(tmp_path / "r"), *flags, "--reuse", bad)
    m = json.load(open(f"{bad}/manifest.json"))
    keys = f"{bad}/{m['shards'][0]['keys']}"
    data = open(keys, "rb").read()
    open(keys, "wb").write(data[: len(data) // 2])           # a truncated key-index file
    assert main(run) == 2
    assert last_error(capsys).startswith(f"error: --reuse {bad}: its key index {m['shards'][0]['keys']} cannot be read")
    open(keys, "wb").write(data)
    outside = json.loads(json.dumps(m))
    outside["shards"][0]["keys"] = "../../elsewhere/part.parquet"            # a path out of the output
    open(f"{bad}/manifest.json", "w").write(json.dumps(outside))
    assert main(run) == 2
    assert last_error(capsys).startswith(f"error: --reuse {bad}: its manifest's shard 0 is damaged")
    del m["key_index"]
    open(f"{bad}/manifest.json", "w").write(json.dumps(m))
    assert main(run) == 2
    assert last_error(capsys).startswith(f"error: --reuse {bad}: its manifest describes no key index")
    os.remove(f"{bad}/manifest.json")
    assert main(run) == 2
    assert last_error(capsys).startswith(f"error: --reuse {bad}: no finished output there")
    missing = str(tmp_path / "nowhere")
    assert main(argv(tiny_model_files, days[1], str(tmp_path / "r"), *flags, "--reuse", missing)) == 2
    assert last_error(capsys).startswith(f"error: --reuse {missing}: no finished output there")


def test_stateful_refuses_reuse(days, tiny_model_files, tmp_path, capsys):
    assert main(argv(tiny_model_files, days[1], str(tmp_path / "s"), "--state", "stateful",
                     "--reuse", str(tmp_path / "x"))) == 2
    assert last_error(capsys) == ("error: --reuse needs --state stateless or warm (a stateful sentence's vectors "
                                  "depend on the sentences before it, so no sentence key names them) (exit 2: fix "
                                  "the command)")


@pytest.mark.slow
def test_the_plan_estimates_sentences_reused(days, tiny_days, tiny_model_files, tmp_path):
    """`plan` with --reuse: the sample's sentences found in the sources' key indexes (the whole small corpus is the
    sample here: exact), and the biLM time counts the tokens left to embed only."""
    from elmo_pipeline.pipeline.dry_run import estimate, render
    outs, flags = tiny_days
    p = estimate(argv(tiny_model_files, days[1], str(tmp_path / "o"), *flags, "--reuse", outs["parquet"]))
    full = read_output(outs["full"])[0]["counts"]["sentences_written"]
    r = p["reuse"]
    ran = str(tmp_path / "r")
    assert main(argv(tiny_model_files, days[1], ran, *flags, "--reuse", outs["parquet"])) == 0
    counts = read_output(ran)[0]["counts"]
    reused = counts["sentences_reused"]
    assert r["sampled_sentences"] == full and r["sampled_found"] == r["sentences_reused"] == reused
    d = p["dedupe"]              # --batch-invariant: dedupe on; what is reused is neither embedded nor deduplicated
    assert (d["sentences_embedded"], d["sentences_deduplicated"]) == (counts["sentences_embedded"],
                                                                      counts["sentences_deduplicated"])
    assert 0 < r["token_share"] < 0.5
    assert f"{reused:,} of the sample's {full:,} sentences found: about {reused:,} sentences reused" in render(p)
    assert estimate(argv(tiny_model_files, days[1], str(tmp_path / "o"), *flags))["reuse"] is None


@pytest.mark.slow       # a killed process
def test_a_run_killed_with_reuse_resumes_without_it(days, tiny_days, tiny_model_files, tmp_path):
    """--reuse is not in the run key: a run killed after committing reused shards resumes without --reuse (the same
    output), and its counts keep the sentences reused from the source, by source."""
    from tests.resume_helpers import run_subprocess
    outs, flags = tiny_days
    out = str(tmp_path / "r")
    args = argv(tiny_model_files, days[1], out, *flags, "--shard-sentences", "50")
    p = run_subprocess([*args, "--reuse", outs["parquet"]], crash_at="commit:3")
    assert p.returncode == -9, p.stderr[-2000:]
    assert main(args) == 0
    got = read_output(out)
    assert_equal_outputs(got, read_output(outs["full"]))
    c = got[0]["counts"]
    assert set(c["sentences_reused_by_source"]) == {outs["parquet"]} and c["sentences_reused"] >= 100
    assert c["sentences_embedded"] + c["sentences_deduplicated"] + c["sentences_reused"] == c["sentences_written"]
    assert "reuse" not in got[0]


@pytest.mark.slow       # a dask.distributed cluster
def test_reuse_on_dask_equals_the_full_run(days, tiny_days, tiny_model_files, tmp_path):
    """DaskRunner on a 2-worker LocalCluster: the join, shuffled by the cluster, writes the full run's output."""
    pytest.importorskip("distributed")
    from distributed import LocalCluster
    from tests.resume_helpers import run_subprocess
    outs, flags = tiny_days
    out = str(tmp_path / "r")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                      env={"OMP_NUM_THREADS": "1"}) as c:
        p = run_subprocess(argv(tiny_model_files, days[1], out, *flags, "--reuse", outs["parquet"], "--runner",
                                "apache_beam.runners.dask.dask_runner.DaskRunner", "--dask_client_address",
                                c.scheduler_address, "--dask_npartitions", "4"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = read_output(out)
    assert_equal_outputs(got, read_output(outs["full"]))
    assert got[0]["counts"]["sentences_reused"] > 0


def test_a_source_url_is_named_without_its_secrets():
    """The error line names the source redacted (fsio/redact.py): user info and query values masked."""
    from elmo_pipeline.pipeline.reuse_sources import open_source
    with pytest.raises(ReuseError) as e:
        open_source("memory://user:topsecret@host/out", "0" * 16, [("layer_0", 4)], "float32")
    assert str(e.value) == ("--reuse memory://***@host/out: no finished output there (no manifest.json of this "
                            "pipeline)")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_source_shard_of_another_model_is_never_copied(fmt, days, tiny_days, tiny_model_files, tmp_path, capsys):
    """Row 1 of the issue: a shard of another model over the same corpus (same counts) copied into the source, or a
    source shard grown or linked elsewhere: the run refuses it, one line (its manifest records each file's size and
    SHA-256), never another model's vectors under this model's manifest."""
    from elmo_pipeline.model.synthetic import write_random_bilm
    outs, flags = tiny_days
    other = write_random_bilm("tiny", str(tmp_path / "other"), seed=11)
    foreign = str(tmp_path / "foreign")
    extra = ("--format", "arrow,hdf5") if fmt == "arrow" else ()
    assert main(argv(other, days[0], foreign, *flags, *extra)) == 0
    src = str(tmp_path / "src")
    shutil.copytree(outs[fmt], src)
    rel = json.load(open(os.path.join(src, "manifest.json")))["shards"][0][fmt]
    shutil.copy(os.path.join(foreign, rel), os.path.join(src, rel))
    capsys.readouterr()
    assert main(argv(tiny_model_files, days[1], str(tmp_path / "r"), *flags, "--reuse", src)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "not the file its manifest records" in err[-1], err[-1]
    assert not os.path.exists(tmp_path / "r" / "manifest.json")


def test_a_key_index_whose_pages_hide_more_than_its_keys_is_refused_undecoded(tmp_path, monkeypatch):
    """transforms/reuse.py _check_key_pages: a key index of the right schema and row count whose keys are 1 MiB
    each (zstd: a file of a few KB; a crafted source's 40 MiB keys took 4 GB) is refused by its page headers before
    pyarrow decodes it; so is one whose footer holds other than the manifest's rows; a real one reads as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elmo_pipeline.formats.parquet import write_key_index
    from elmo_pipeline.model.resolve import sentence_key
    from elmo_pipeline.transforms import reuse
    good, bomb = str(tmp_path / "good.parquet"), str(tmp_path / "bomb.parquet")
    with open(good, "wb") as f:
        write_key_index([f"x#{i}" for i in range(4)], [sentence_key("0123456789abcdef", [w]) for w in "abcd"], f)
    schema = pq.read_schema(good)
    pq.write_table(pa.table({"id": [f"x#{i}" for i in range(4)], "key": ["a" * (1 << 20)] * 4}, schema=schema), bomb,
                   compression="zstd", use_dictionary=False)
    assert os.path.getsize(bomb) < 20_000
    assert len(list(index_blobs(0, 0, good, 3, rows=4))) > 0
    with pytest.raises(ReuseError, match="no sentence keys"):
        list(index_blobs(0, 0, good, 3, rows=5))
    monkeypatch.setattr(reuse.pq, "read_table", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ReuseError, match="no sentence keys"):
        list(index_blobs(0, 0, bomb, 3, rows=4))


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_a_source_shard_that_decodes_to_more_than_its_counts_is_refused_undecoded(fmt, tmp_path, monkeypatch):
    """A source's data shard of the right schema whose pages (zstd) or compressed Arrow batches decode to far more
    than its manifest's sentences and tokens (a file of a few KB holding 64 MiB of floats; its manifest edited to
    record it): ReuseError naming it, refused by its page headers or batch metadata before anything is decoded; the
    plan's key lookup (found_keys) reads a key index under the same check."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from elmo_pipeline.pipeline.reuse_sources import found_keys
    from elmo_pipeline.transforms import reuse
    from elmo_pipeline.transforms.reuse import ReuseSource, read_vectors
    n, width = 2, 1 << 23
    row = pa.array([np.zeros(width, np.float32)] * n, pa.list_(pa.float32()))
    path = str(tmp_path / f"bomb.{fmt}")
    if fmt == "parquet":
        layer = pa.ListArray.from_arrays(pa.array([0, 1, 2], pa.int32()), row.cast(pa.list_(pa.float32(), width)))
        pq.write_table(pa.table({"tokens": [["a"], ["b"]], "layer_0": layer}), path, compression="zstd",
                       use_dictionary=False)
    else:
        table = pa.table({"id": pa.array(["d#0", "d#1"]).dictionary_encode(), "token": ["a", "b"],
                          "layer_0": row.cast(pa.list_(pa.float32(), width))})
        with pa.ipc.new_file(path, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
            w.write_table(table)
    assert os.path.getsize(path) < 100_000
    source = ReuseSource("src", "src", fmt, (("keys.parquet", path, n),), tokens=(n,))
    monkeypatch.setattr(reuse.pq, "read_table", lambda *a, **k: pytest.fail("decoded"))
    monkeypatch.setattr(pa.ipc, "open_file", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ReuseError, match=f"^--reuse src: its shard {re.escape(path)} cannot be read back"):
        read_vectors(source, 0, [0, 1], [("layer_0", 4)])
    bomb = str(tmp_path / "keys.parquet")
    pq.write_table(pa.table({"id": ["x#0", "x#1"], "key": ["a" * (1 << 20)] * 2}), bomb, compression="zstd",
                   use_dictionary=False)
    with pytest.raises(ReuseError, match="no sentence keys"):
        found_keys([ReuseSource("src", "src", "parquet", ((bomb, path, 2),), tokens=(2,))], {"k"})
