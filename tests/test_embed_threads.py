"""Several batches in the biLM at once (EmbedBatches threads, --embed-threads): the same batches, vectors bit for bit,
dead letters and order as one at a time; how the flag resolves."""
import os

import numpy as np
import pytest

from elmo_pipeline.transforms.records import Item

WORDS = "the cat sat on a mat while dogs ran far away and birds sang loud songs".split()


def _batches(n_batches: int = 12) -> list[list[Item]]:
    rng = np.random.default_rng(3)
    out = []
    for b in range(n_batches):
        batch = []
        for s in range(int(rng.integers(1, 6))):
            tokens = tuple(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(1, 12))))
            if b == 4 and s == 0:
                tokens = ("BOOM", *tokens)          # this sentence fails in the biLM: a dead letter
            batch.append(Item(f"d{b}#{s}", f"d{b}", s, tokens, tuple((i, i + 1) for i in range(len(tokens)))))
        out.append(batch)
    return out


def _run(model_files, threads: int) -> list:
    """Every output of EmbedBatches(threads) over _batches(), process() and finish_bundle() in order."""
    from apache_beam.utils.windowed_value import WindowedValue

    from elmo_pipeline.transforms.embed_step import EmbedBatches
    from elmo_pipeline.model.resolve import ModelSpec
    d = EmbedBatches(ModelSpec(*model_files, device="cpu"), threads=threads)
    d.setup()
    embed = d.embedder.embed_packed

    def failing(sentences, layers=None, prepared=None):
        if any("BOOM" in s for s in sentences):
            raise ValueError("boom")
        return embed(sentences, layers, prepared)
    d.embedder.embed_packed = failing
    try:
        d.start_bundle()
        outs = [o for batch in _batches() for o in d.process(batch)]
        outs += [o.value if isinstance(o, WindowedValue) else o for o in d.finish_bundle()]
    finally:
        d.embedder.embed_packed = embed
        d.teardown()
    return outs


def test_two_threads_give_the_batches_of_one(tmp_path):
    """Separate model files (so separate embedders and token caches, filled in the same order): equal output."""
    from apache_beam.pvalue import TaggedOutput

    from elmo_pipeline.model.synthetic import write_random_bilm
    one = _run(write_random_bilm("tiny", str(tmp_path / "a"), seed=1), threads=1)
    two = _run(write_random_bilm("tiny", str(tmp_path / "b"), seed=1), threads=2)
    assert len(one) == len(two) > 12
    letters = [o.value for o in two if isinstance(o, TaggedOutput)]
    assert [x.id for x in letters] == ["d4#0"] and "ValueError: boom" in letters[0].reason
    for a, b in zip(one, two):
        assert type(a) is type(b)
        if isinstance(a, TaggedOutput):
            assert a.value == b.value
            continue
        assert [i.id for i in a.items] == [i.id for i in b.items]
        assert np.array_equal(a.offsets, b.offsets)
        assert a.vectors.tobytes() == b.vectors.tobytes()


def test_embed_threads_resolution(monkeypatch):
    from elmo_pipeline.pipeline.workers import embed_threads as n
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert n(0, 1, True, "stateless") == 2 and n(0, 1, True, "warm") == 2
    assert n(0, 2, True, "stateless") == 1          # the default torch threads already use both cores
    assert n(0, 1, True, "stateful") == 1 and n(0, 1, False, "stateless") == 1
    assert n(0, 1, True, "stateless", workers=2) == 1 and n(3, 2, False, "stateless") == 3
    assert n(0, 1, True, "stateless", tokenizer_children=2) == 1      # the children take the second core
    assert n(2, 1, True, "stateless", tokenizer_children=2) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert n(0, 1, True, "stateless") == 1


@pytest.mark.parametrize("extra,message", [
    (["--embed-threads", "-1"], "--embed-threads must be >= 0"),
    (["--embed-threads", "2", "--state", "stateful"], "--embed-threads > 1 needs --state stateless or warm"),
])
def test_bad_embed_threads_is_a_clear_error(tmp_path, tiny_model_files, extra, message, capsys):
    from elmo_pipeline.pipeline.run import main
    from tests.resume_helpers import argv
    corpus = tmp_path / "in.txt"
    corpus.write_text("A sentence.\n")
    assert main(argv(tiny_model_files, str(corpus), str(tmp_path / "out"), *extra)) != 0
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_pipeline_output_same_with_one_and_two_embed_threads(tmp_path, tiny_model_files):
    """Dirty input, small batches (many in flight): equal outputs, Parquet and HDF5 files byte for byte."""
    from tests.resume_helpers import assert_flag_changes_no_byte
    assert_flag_changes_no_byte(tmp_path, tiny_model_files, "--embed-threads", ("1", "2"),
                                "--max-sentence-tokens", "24", "--max-tokens-per-batch", "64")
