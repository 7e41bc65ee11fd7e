"""Long sentences as overlapping windows (model/windows.py), without Beam, on a tiny random biLM."""
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder
from tests.conftest import needs_invariant_device
from elmo_pipeline.model.windows import (check_window, effective_overlap, effective_window, embed_long, embed_long_many, stitch_plan,
                           window_groups, window_spans)


@pytest.fixture(scope="module")
def embedder(tiny_model_files):
    return ElmoEmbedder(*tiny_model_files)


def _tokens(n):
    words = "the cat sat on a mat while rain fell over old harbour walls , and then .".split()
    return [words[(i * 7) % len(words)] + ("" if i % 5 else str(i % 13)) for i in range(n)]


class BudgetRecorder:
    """The real embedder, recording the padded size of every batch it is given."""
    def __init__(self, e):
        self.e, self.state_mode, self.slots = e, e.state_mode, []

    def embed_batch(self, sentences):
        self.slots.append(len(sentences) * (max(len(s) for s in sentences) + 2))
        return self.e.embed_batch(sentences)


@pytest.mark.parametrize("n,w,v", [(1, 10, 2), (10, 10, 2), (11, 10, 2), (25, 10, 3), (100, 7, 6), (57, 20, 0)])
def test_spans_cover_and_plan_partitions(n, w, v):
    spans = window_spans(n, w, v)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(e - s == min(w, n) for s, e in spans)
    assert all(b[0] - a[0] <= w - v for a, b in zip(spans, spans[1:]))        # stride at most w - v
    plan = stitch_plan(spans)
    assert plan[0][0] == 0 and plan[-1][1] == n and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for (s, e), (lo, hi) in zip(spans, plan):
        assert s <= lo <= hi <= e
        if len(spans) > 1:            # a position has >= floor(v/2) tokens each side in its window (inside the sentence)
            for p in range(lo, hi):
                assert p - s >= min(v // 2, p) and e - 1 - p >= min(v // 2, n - 1 - p)


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="smaller than --window-tokens"):
        check_window(10, 10, 4096)
    with pytest.raises(ValueError, match=">= 1"):
        check_window(10, 2, 0)
    check_window(1000, 200, 100)            # the budget caps the window at 98 and scales the overlap to 19
    assert effective_window(1000, 4096) == 1000 and effective_window(1000, 500) == 498
    assert effective_overlap(1000, 200, 4096) == 200 and effective_overlap(1000, 200, 100) == 19


def test_short_sentence_is_exactly_embed_sentence(embedder):
    toks = _tokens(30)
    assert np.array_equal(embed_long(embedder, toks, 30, 5, 4096), embedder.embed_sentence(toks))
    assert np.array_equal(embed_long(embedder, toks, 1000, 200, 4096), embedder.embed_sentence(toks))


def test_long_sentence_positions_come_from_their_window(embedder):
    toks = _tokens(95)
    w, v, budget = 20, 6, 70          # 3 windows per sub-batch
    rec = BudgetRecorder(embedder)
    out = embed_long(rec, toks, w, v, budget)
    assert out.shape == (embedder.n_layers, 95, embedder.output_dim) and out.dtype == np.float32
    assert rec.slots and max(rec.slots) <= budget and len(rec.slots) > 1
    spans = window_spans(95, w, v)
    for (s, e), (lo, hi) in zip(spans, stitch_plan(spans)):
        alone = embedder.embed_sentence(toks[s:e])
        np.testing.assert_allclose(out[:, lo:hi], alone[:, lo - s: hi - s], atol=1e-5)
    # layer 0 is the context-free token vector everywhere
    for p in (0, 13, 14, 50, 94):
        np.testing.assert_allclose(out[0, p], embedder.embed_sentence([toks[p]])[0, 0], atol=1e-5)


@needs_invariant_device
def test_many_sentences_share_the_sub_batches(embedder, tiny_model_files):
    sents = [_tokens(95), _tokens(12), _tokens(61), _tokens(21)]      # 12 tokens: one window, the sentence whole
    w, v, budget = 20, 6, 70          # 3 windows per sub-batch
    rec = BudgetRecorder(embedder)
    got = embed_long_many(rec, sents, w, v, budget)
    windows = sum(len(window_spans(len(s), w, v)) for s in sents)
    assert len(rec.slots) == -(-windows // 3) and max(rec.slots) <= budget      # sub-batches cross sentences
    for s, g in zip(sents, got):
        assert g.shape == (embedder.n_layers, len(s), embedder.output_dim)
        np.testing.assert_allclose(g, embed_long(embedder, s, w, v, budget), atol=1e-5)
    exact = ElmoEmbedder(*tiny_model_files, batch_invariant=True)     # the same bits whatever shares a batch
    for s, g in zip(sents, embed_long_many(exact, sents, w, v, budget)):
        assert np.array_equal(g, embed_long(exact, s, w, v, budget))


def test_pipeline_embeds_a_batch_s_long_sentences_together(tiny_model_files, tmp_path, embedder):
    from tests.pipeline_helpers import hdf5_arrays, run_pipeline
    from elmo_pipeline.formats.hdf5 import hdf5_key

    lines = [" ".join(_tokens(n)) for n in (95, 8, 61, 40, 5)]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    from elmo_pipeline.pipeline.run import counters

    result, manifest = run_pipeline(tiny_model_files, str(inp), out, "--tokenizer", "whitespace", "--format", "hdf5",
                                    "--window-tokens", "20", "--window-overlap", "6", "--max-tokens-per-batch", "256")
    arrays = hdf5_arrays(out, manifest)
    assert counters(result)["windowed_sentences"] == 3 and len(arrays) == len(lines)
    for i, line in enumerate(lines):
        want = embed_long(embedder, line.split(), 20, 6, 256)
        np.testing.assert_allclose(arrays[hdf5_key(f"in.txt:{i + 1}#0")], want, atol=1e-5)


def test_window_capped_by_budget(embedder):
    toks = _tokens(40)
    rec = BudgetRecorder(embedder)
    out = embed_long(rec, toks, 1000, 4, 16)     # window 14 tokens, one window per batch
    assert out.shape[1] == 40 and max(rec.slots) <= 16


def test_stateful_is_refused(tiny_model_files):
    e = ElmoEmbedder(*tiny_model_files, state="stateful")
    with pytest.raises(ValueError, match="stateful"):
        embed_long(e, _tokens(50), 20, 4, 100)


@needs_invariant_device
def test_elmo_command_windows(tiny_model_files, tmp_path, embedder):
    import h5py

    from elmo_pipeline.pipeline.cli import main
    long, short = _tokens(50), ["a", "short", "one"]
    inp = tmp_path / "in.txt"
    inp.write_text(" ".join(long) + "\n" + " ".join(short) + "\n")
    out = tmp_path / "o.hdf5"
    model = ["--options-file", tiny_model_files[0], "--weight-file", tiny_model_files[1]]
    assert main(["elmo", str(inp), str(out), "--all", "--window-tokens", "20", "--window-overlap", "4", *model]) == 0
    with h5py.File(out) as f:
        np.testing.assert_allclose(f["0"][...], embed_long(embedder, long, 20, 4, 22), atol=1e-5)
        np.testing.assert_allclose(f["1"][...], embedder.embed_sentence(short), atol=1e-5)
    with pytest.raises(SystemExit, match="stateless or warm"):
        main(["elmo", str(inp), str(out), "--all", "--window-tokens", "20", "--state", "stateful", *model])
    # a line's windows run together (--batch-size of them a sub-batch): the bits of one window per call
    exact = ElmoEmbedder(*tiny_model_files, batch_invariant=True)
    assert main(["elmo", str(inp), str(out), "--all", "--window-tokens", "20", "--window-overlap", "4",
                 "--batch-invariant", *model]) == 0
    with h5py.File(out) as f:
        assert np.array_equal(f["0"][...], embed_long(exact, long, 20, 4, 22))


def test_window_groups_fill_one_sub_batch_in_order():
    lengths = [95, 12, 61, 21, 300, 40, 40]     # windows of 20 with overlap 6: 7, 1, 5, 2, 22, 3, 3
    groups = window_groups(lengths, 20, 6, 8 * 22)           # 8 windows a sub-batch
    assert groups == [[0, 1], [2, 3], [4], [5, 6]]
    assert [i for g in groups for i in g] == list(range(len(lengths))) and window_groups([], 20, 6, 100) == []


@needs_invariant_device
def test_elmo_command_runs_several_lines_windows_together(tiny_model_files, tmp_path, monkeypatch):
    """Long lines between short ones: their windows share sub-batches of --batch-size windows, and each line
    still gets its own vectors under its own key (the same bits as alone under --batch-invariant)."""
    import h5py

    from elmo_pipeline.pipeline.cli import main
    lines = [_tokens(50), ["a", "short", "one"], _tokens(44), _tokens(61), ["and", "another"], _tokens(30)]
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(" ".join(t) for t in lines) + "\n")
    out = tmp_path / "o.hdf5"
    calls = []
    real = ElmoEmbedder.embed_batch
    monkeypatch.setattr(ElmoEmbedder, "embed_batch", lambda self, s: calls.append(len(s)) or real(self, s))
    assert main(["elmo", str(inp), str(out), "--all", "--window-tokens", "20", "--window-overlap", "4", "--batch-size",
                 "8", "--batch-invariant", "--options-file", tiny_model_files[0], "--weight-file",
                 tiny_model_files[1]]) == 0
    exact = ElmoEmbedder(*tiny_model_files, batch_invariant=True)
    # the long lines' windows: 3, 3, 4, 2; two sub-batches of two lines each, not four of one line
    assert [len(window_spans(len(t), 20, 4)) for t in lines if len(t) > 20] == [3, 3, 4, 2]
    assert calls == [6, 6, 6]         # the six lines (long ones as placeholders), then the two sub-batches
    with h5py.File(out) as f:
        for i, toks in enumerate(lines):
            want = embed_long(exact, toks, 20, 4, 8 * 22) if len(toks) > 20 else exact.embed_sentence(toks)
            assert np.array_equal(f[str(i)][...], want), i


def test_a_failing_windowed_sentence_is_a_dead_letter_and_the_others_come_out(tiny_model_files, embedder):
    """The windows of a batch's long sentences run together; when that fails, each is retried alone: the one that
    still fails is a dead letter with its reason, the others keep their vectors and their order."""
    from elmo_pipeline.transforms.records import Item
    from tests.pipeline_helpers import embed_failing

    sents = [_tokens(61), ["BOOM", *_tokens(40)], _tokens(8), _tokens(33)]
    batch = [Item(f"d#{i}", "d", i, tuple(s), tuple((j, j + 1) for j in range(len(s)))) for i, s in enumerate(sents)]
    dead, done = embed_failing(tiny_model_files, batch, window=20, overlap=6, max_tokens=256)
    assert len(dead) == 1 and dead[0].id == "d#1" and dead[0].reason == "embedding failed: ValueError: boom"
    assert [i.id for b in done for i in b.items] == ["d#2", "d#0", "d#3"]     # the short one, then the windowed
    long = {b.items[0].id: b.vectors for b in done if b.items[0].id != "d#2"}
    for i in (0, 3):
        np.testing.assert_allclose(long[f"d#{i}"], embed_long(embedder, sents[i], 20, 6, 256), atol=1e-5)
