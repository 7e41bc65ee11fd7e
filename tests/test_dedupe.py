"""--dedupe (transforms/dedupe.py, pipeline/graph.py): the sentences of one run with the same sentence key are
embedded once and written for every occurrence; outputs equal those of a run without it (bit for bit with
--batch-invariant), and the counts say how many sentences were embedded and how many deduplicated."""
import random

import numpy as np
import pytest

from elmo_pipeline.pipeline.run import main
from elmo_pipeline.transforms.dedupe import one_of_each, with_copies
from elmo_pipeline.transforms.records import EmbeddedBatch, Item
from elmo_pipeline.model.kernels import exact_here
from tests.resume_helpers import HOW, LAYERS, argv, read_output

BOILERPLATE = ["Subscribe to our newsletter for more stories.", "All rights reserved.",
               "Click here to read the full article.", "Share this page with your friends."]
WORDS = "the a cat dog river stone city night market old young green walks sees finds keeps near under".split()


def web_corpus(path, n_docs=40, seed=3):
    """Pages of 2-3 sentences of their own and 1-3 boilerplate sentences, every fifth page a copy of the one
    before it: a web crawl's repetition. Returns (path, sentences, distinct sentences)."""
    rng = random.Random(seed)
    pages, sentences = [], []
    for d in range(n_docs):
        if d % 5 == 4:
            page = list(pages[-1])
        else:
            own = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                   for _ in range(rng.randint(2, 3))]
            page = own + rng.sample(BOILERPLATE, rng.randint(1, 3))
        pages.append(page)
        sentences += page
    path.write_text("".join(" ".join(p) + "\n" for p in pages))
    return str(path), len(sentences), len(set(sentences))


def without_dedupe_counts(m):
    return {k: v for k, v in m["counts"].items() if k not in HOW}


def assert_equal_outputs(a, b):
    """Same ids, tokens, offsets, counts (the dedupe counts aside), dead letters and vectors, bit for bit."""
    (ma, ra, ha, da), (mb, rb, hb, db) = a, b
    assert without_dedupe_counts(ma) == without_dedupe_counts(mb)
    assert sorted(ra) == sorted(rb) and sorted(ha) == sorted(hb) and da == db
    for sid, x in ra.items():
        for k, v in x.items():
            assert (np.array(v, np.float32).tobytes() == np.array(rb[sid][k], np.float32).tobytes()
                    if k in LAYERS else v == rb[sid][k]), (sid, k)
    for k in ha:
        assert ha[k].tobytes() == hb[k].tobytes(), k


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return web_corpus(tmp_path_factory.mktemp("web") / "pages.txt")


def test_each_sentence_key_is_embedded_once_and_written_for_every_occurrence(corpus, tiny_model_files, tmp_path,
                                                                              capsys):
    """--batch-invariant: dedupe is on by default (exact); embedded sentences = distinct keys, the others are
    written with their vectors; the output equals a run without dedupe bit for bit, under another budget too."""
    path, n, distinct = corpus
    assert n - distinct > n // 4               # the corpus repeats: over a quarter of its sentences
    extra = ("--batch-invariant", "--shard-sentences", "16", "--max-tokens-per-batch", "128")
    on, off = str(tmp_path / "on"), str(tmp_path / "off")
    assert main(argv(tiny_model_files, path, on, *extra)) == 0
    line = capsys.readouterr().err
    assert main(argv(tiny_model_files, path, off, *extra, "--dedupe", "off", "--max-tokens-per-batch", "512")) == 0
    got, ref = read_output(on), read_output(off)
    c = got[0]["counts"]
    assert c["sentences_written"] == c["sentences"] == n and c["dead_letter_sentences"] == 0
    assert (c["sentences_embedded"], c["sentences_deduplicated"]) == (distinct, n - distinct)
    assert c["sentences_embedded"] + c["sentences_deduplicated"] == c["sentences_written"]
    assert exact_here(got[0]["kernel_path"], True)      # batch-invariant on a CPU: the row rule held by check here
    assert got[0]["dedupe"] == {"scope": "run", "exact": True} and "dedupe" not in ref[0]
    assert "sentences_embedded" not in ref[0]["counts"]
    assert f"{n} sentences ({distinct} embedded, {n - distinct} deduplicated)" in line
    prom = open(f"{on}/metrics.prom").read()
    assert f'elmo_pipeline_sentences_deduplicated_total{{output="{on}"}} {n - distinct}' in prom
    assert f'elmo_pipeline_sentences_embedded_total{{output="{on}"}} {distinct}' in prom
    assert "deduplicated" not in open(f"{off}/metrics.prom").read()
    assert_equal_outputs(got, ref)


def test_dedupe_on_without_batch_invariance_equals_to_round_off(corpus, tiny_model_files, tmp_path):
    """--dedupe on without --batch-invariant: the copies carry the vectors of the one embedded, equal to their
    own to float32 round-off; the auto default is off there (not exact)."""
    path, n, distinct = corpus
    on, auto = str(tmp_path / "on"), str(tmp_path / "auto")
    assert main(argv(tiny_model_files, path, on, "--dedupe", "on")) == 0
    assert main(argv(tiny_model_files, path, auto)) == 0
    got, ref = read_output(on), read_output(auto)
    assert got[0]["counts"]["sentences_embedded"] == distinct and "sentences_embedded" not in ref[0]["counts"]
    assert got[0]["dedupe"] == {"scope": "run", "exact": False}
    assert sorted(got[1]) == sorted(ref[1])
    for sid, row in got[1].items():
        for k in LAYERS:
            np.testing.assert_allclose(np.array(row[k], np.float32), np.array(ref[1][sid][k], np.float32), atol=1e-5)


def test_stateful_refuses_dedupe_on(corpus, tiny_model_files, tmp_path, capsys):
    assert main(argv(tiny_model_files, corpus[0], str(tmp_path / "s"), "--state", "stateful", "--dedupe", "on")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: --dedupe on needs --state stateless or warm (a stateful sentence's vectors depend "
                       "on the sentences before it) (exit 2: fix the command)")


def test_copies_are_written_with_the_vectors_of_their_sentence():
    """with_copies: each copy's rows are its item's, after every item of the batch; one_of_each keeps the
    smallest id."""
    def item(i, tokens):
        return Item(f"d#{i}", "d", i, tokens, tuple((k, k + 1) for k in range(len(tokens))))
    a, b, c, d = item(0, ("x", "y")), item(1, ("z",)), item(2, ("x", "y")), item(3, ("x", "y"))
    first = one_of_each([d, c, a])
    assert first.id == "d#0" and [x.id for x in first.copies] == ["d#2", "d#3"]
    assert one_of_each([b]) is b
    vectors = np.arange(3 * 3 * 4, dtype=np.float32).reshape(3, 3, 4)
    out = with_copies(EmbeddedBatch([first, b], vectors, np.array([0, 2, 3]), None))
    assert [i.id for i in out.items] == ["d#0", "d#1", "d#2", "d#3"] and out.copies == 2
    assert all(not i.copies for i in out.items) and out.offsets.tolist() == [0, 2, 3, 5, 7]
    for k in (2, 3):
        assert out.vectors[:, out.offsets[k]:out.offsets[k + 1]].tobytes() == vectors[:, 0:2].tobytes()
    assert out.vectors[:, :3].tobytes() == vectors.tobytes()


def test_copies_go_through_the_coders():
    """An Item's copies and an EmbeddedBatch's count of copies survive encoding between stages."""
    from elmo_pipeline.transforms.coders import EmbeddedBatchCoder, ItemCoder
    a = Item("d#0", "d", 0, ("x", "y"), ((0, 1), (2, 3)), 7)
    first = one_of_each([a, Item("e#1", "e", 1, ("x", "y"), ((4, 5), (6, 7)), 3)])
    got = ItemCoder().decode(ItemCoder().encode(first))
    assert got == first and got.copies[0].nbytes == 3
    batch = with_copies(EmbeddedBatch([first], np.ones((3, 2, 4), np.float32), np.array([0, 2]), None))
    back = EmbeddedBatchCoder().decode(EmbeddedBatchCoder().encode(batch))
    assert back.copies == 1 and back.items == batch.items and back.vectors.tobytes() == batch.vectors.tobytes()


def test_the_plan_estimates_sentences_embedded_and_deduplicated(corpus, tiny_model_files, tmp_path):
    """`plan` with dedupe on: the sample's distinct sentence keys give the sentences embedded and deduplicated
    (the whole small corpus is the sample here: exact), and the biLM time counts the embedded tokens only."""
    from elmo_pipeline.pipeline.dry_run import estimate, render
    path, n, distinct = corpus
    p = estimate(argv(tiny_model_files, path, str(tmp_path / "o"), "--batch-invariant"))
    d = p["dedupe"]
    assert (d["sampled_sentences"], d["sampled_distinct"]) == (n, distinct)
    assert (d["sentences_embedded"], d["sentences_deduplicated"]) == (distinct, n - distinct)
    assert 0 < d["token_share"] < 1
    assert f"about {distinct:,} sentences embedded, {n - distinct:,} deduplicated" in render(p)
    assert estimate(argv(tiny_model_files, path, str(tmp_path / "o")))["dedupe"] is None     # auto: off here


def test_a_failing_sentence_dead_letters_every_occurrence(tiny_model_files):
    """A sentence that fails embedding even alone is a dead letter for each of its occurrences; another's copies
    are written with its vectors: nothing is lost."""
    from tests.pipeline_helpers import embed_failing

    def item(i, tokens):
        return Item(f"d#{i}", "d", i, tuple(tokens), tuple((j, j + 1) for j in range(len(tokens))))
    boom = ["BOOM"] + ["word"] * 30             # windowed (window 20), fails
    fine = ["a", "short", "one"]
    batch = [one_of_each([item(0, boom), item(2, boom), item(4, boom)]), one_of_each([item(1, fine), item(3, fine)])]
    dead, done = embed_failing(tiny_model_files, batch, window=20, overlap=6, max_tokens=256)
    assert sorted(d.id for d in dead) == ["d#0", "d#2", "d#4"]
    assert [[i.id for i in b.items] for b in done] == [["d#1", "d#3"]] and done[0].copies == 1
    assert done[0].vectors[:, 0:3].tobytes() == done[0].vectors[:, 3:6].tobytes()


def test_each_shard_has_a_key_index_described_in_the_manifest(corpus, tiny_model_files, tmp_path):
    """Stateless: keys/part-i holds shard i's sentence ids and sentence keys row for row (the model's key prefix
    and a hash of the tokens: equal tokens, equal keys); the manifest describes it. Stateful: none."""
    import os

    import pyarrow.parquet as pq

    from elmo_pipeline.model.resolve import sentence_key
    path, n, distinct = corpus
    out = str(tmp_path / "o")
    assert main(argv(tiny_model_files, path, out, "--shard-sentences", "50")) == 0
    m, rows, _, _ = read_output(out)
    index = m["key_index"]
    assert index["folder"] == "keys" and index["columns"] == ["id", "key"]
    assert len(index["key_prefix"]) == 16
    keys = {}
    assert len(m["shards"]) == 4 and sorted(os.listdir(f"{out}/keys")) == sorted(
        os.path.basename(s["keys"]) for s in m["shards"])
    for s in m["shards"]:
        k = pq.read_table(f"{out}/{s['keys']}").to_pylist()
        ids = pq.read_table(f"{out}/{s['parquet']}", columns=["id"]).column("id").to_pylist()
        assert [r["id"] for r in k] == ids
        for r in k:
            assert r["key"] == sentence_key(index["key_prefix"], rows[r["id"]]["tokens"])
            keys[r["key"]] = tuple(rows[r["id"]]["tokens"])
    assert len(keys) == distinct and len(set(keys.values())) == distinct
    again = str(tmp_path / "f16")           # a setting that changes the vectors: another prefix
    assert main(argv(tiny_model_files, path, again, "--dtype", "float16")) == 0
    assert read_output(again)[0]["key_index"]["key_prefix"] != index["key_prefix"]
    stateful = str(tmp_path / "s")
    assert main(argv(tiny_model_files, path, stateful, "--state", "stateful")) == 0
    ms = read_output(stateful)[0]
    assert "key_index" not in ms and not os.path.exists(f"{stateful}/keys") and "keys" not in ms["shards"][0]


def test_the_key_index_is_owned_like_the_shards(corpus, tiny_model_files, tmp_path, capsys):
    """A file of someone else's in keys/ refuses even --overwrite (readers glob the folder); without it,
    --overwrite replaces the key index with the new run's."""
    import os
    out = str(tmp_path / "o")
    assert main(argv(tiny_model_files, corpus[0], out, "--shard-sentences", "100")) == 0
    open(f"{out}/keys/mine.parquet", "w").write("x")
    assert main(argv(tiny_model_files, corpus[0], out, "--shard-sentences", "60", "--overwrite")) == 2
    assert "did not write where its output goes: keys/mine.parquet" in capsys.readouterr().err
    os.remove(f"{out}/keys/mine.parquet")
    assert main(argv(tiny_model_files, corpus[0], out, "--shard-sentences", "60", "--overwrite")) == 0
    m = read_output(out)[0]
    assert sorted(os.listdir(f"{out}/keys")) == sorted(os.path.basename(s["keys"]) for s in m["shards"])
    assert len(m["shards"]) == 4


@pytest.mark.slow
def test_two_worker_processes_embed_each_key_once(corpus, tiny_model_files, tmp_path):
    """The grouping by key crosses worker processes: with two, each key is still embedded once, and the
    output equals a one-worker run without dedupe bit for bit."""
    path, n, distinct = corpus
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    assert main(argv(tiny_model_files, path, two, "--batch-invariant", "--direct_num_workers", "2",
                     "--direct_running_mode", "multi_processing")) == 0
    assert main(argv(tiny_model_files, path, one, "--batch-invariant", "--dedupe", "off")) == 0
    got = read_output(two)
    assert (got[0]["counts"]["sentences_embedded"], got[0]["counts"]["sentences_deduplicated"]) == (distinct, n - distinct)
    assert_equal_outputs(got, read_output(one))
