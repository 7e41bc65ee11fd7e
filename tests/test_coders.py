"""Element coders (transforms/coders.py): exact, deterministic round trips, found by Beam's registry; and the
whole graph with every element encoded and decoded between stages (a Reshuffle at every stage boundary:
Plan.break_fusion) gives what the fused in-process run gives."""
import dataclasses

import numpy as np
import pytest
from apache_beam import coders as beam_coders

from elmo_pipeline.formats.layout import DeadLetter, ShardInfo
from tests.resume_helpers import argv, assert_same_output, read_output
from elmo_pipeline.transforms import coders
from elmo_pipeline.transforms.records import Document, EmbeddedBatch, Item

ITEM = Item("d\n:1#0", "d\n:1", 0, ("héllo", "<unk>", "@-@", ""), ((0, 5), (6, 11), (11, 12), (2**40, 2**40 + 1)))
SAMPLES = [
    Document("doc:1", "Text with ünïcode, \x00 and \U0001F600.", True, ""),
    Document("x", "One sentence", False, "a.jsonl:7"),
    ITEM,
    Item("e:2#3", "e:2", 3, (), ()),
    Item("e:2#4", "e:2", 4, ("a",), ((0, 1),), nbytes=2**40),
    Item("e:2#5", "e:2", 5, ("a",), ((0, 1),), key="prefix-0123456789abcdef0123456789abcdef"),
    Document("y", "z", nbytes=123),
    DeadLetter("f:2", "invalid UTF-8: bad byte", "\ufffd excerpt", "record"),
    ShardInfo({"parquet": "s/a.parquet", "hdf5": "s/a.hdf5"}, 2, 7, "d:1#0", {"by_reason": {"too long": 1}}),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_round_trip_exact_and_deterministic(value):
    coder = beam_coders.registry.get_coder(type(value))
    assert type(coder) is coders.CODERS[type(value)] and coder.is_deterministic()
    data = coder.encode(value)
    assert coder.decode(data) == value and coder.encode(coder.decode(data)) == data
    for field in ("nbytes", "key"):        # not compared by ==
        assert getattr(coder.decode(data), field, None) == getattr(value, field, None)
    assert b"\x80\x04" not in data[:2]         # not a pickle


def test_embedded_batch_vectors_bit_for_bit():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 5, 4)).astype(np.float32)
    vectors[0, 0, 0] = np.float32(1e-45)       # a subnormal survives too
    batch = EmbeddedBatch([ITEM, Item("e:2#0", "e:2", 0, ("a",), ((0, 1),))], vectors, np.array([0, 4, 5]))
    coder = beam_coders.registry.get_coder(EmbeddedBatch)
    got = coder.decode(coder.encode(batch))
    assert got.items == batch.items and got.offsets.dtype == np.int64 and list(got.offsets) == [0, 4, 5]
    assert got.vectors.dtype == np.float32 and got.vectors.tobytes() == vectors.tobytes()
    got.vectors[0, 0, 0] = 1.0                  # writable, like the embedder's output
    assert coder.encode(batch) == coder.encode(batch)
    assert got.layers is None
    some = EmbeddedBatch(batch.items, vectors[[0, 2]], batch.offsets, (0, 2))      # only layers 0 and 2
    got = coder.decode(coder.encode(some))
    assert got.layers == (0, 2) and got.vectors.tobytes() == vectors[[0, 2]].tobytes()
    assert got.kernel is None
    kernel = '{"device": "cpu", "lstm_loop": ["onednn"]}'          # the kernel path that embedded them
    assert coder.decode(coder.encode(dataclasses.replace(batch, kernel=kernel))).kernel == kernel


@pytest.fixture
def break_fusion(monkeypatch):
    """break_fusion(True): the runs after it plan a Reshuffle at every stage boundary (Plan.break_fusion);
    break_fusion(False): fused again."""
    from elmo_pipeline.pipeline import plan, run

    def set_to(on: bool):
        monkeypatch.setattr(run, "plan", lambda *a, **k: dataclasses.replace(plan.plan(*a, **k), break_fusion=on))
    return set_to


@pytest.mark.slow
def test_every_element_encoded_between_stages_equals_the_fused_run(tmp_path, tiny_model_files, monkeypatch,
                                                                    break_fusion):
    """With a Reshuffle at every stage boundary, Documents and Items (and the id grouping's key-value pairs)
    go through their coders; ids, tokens, offsets, counts, dead letters and vectors equal the fused run."""
    from elmo_pipeline.pipeline.run import main
    from tests.test_dask import dirty_corpus
    files = dirty_corpus(tmp_path / "corpus")
    extra = ("--shard-sentences", "8", "--max-tokens-per-batch", "256", "--max-sentence-tokens", "24")
    fused = str(tmp_path / "fused")
    assert main(argv(tiny_model_files, files, fused, *extra)) == 0
    calls = {}
    for t, c in coders.CODERS.items():
        def counted(self, value, _encode=c.encode, _name=t.__name__):
            calls[_name] = calls.get(_name, 0) + 1
            return _encode(self, value)
        monkeypatch.setattr(c, "encode", counted)
    break_fusion(True)
    broken = str(tmp_path / "broken")
    assert main(argv(tiny_model_files, files, broken, *extra)) == 0
    ref = read_output(fused)
    assert ref[0]["counts"]["dead_letters"] > 3 and ref[0]["counts"]["sentences_written"] > 40
    assert_same_output(read_output(broken), ref)
    assert calls.get("Document", 0) >= ref[0]["counts"]["documents"], calls
    assert calls.get("Item", 0) >= ref[0]["counts"]["sentences_written"], calls

    # --id-field: the documents are grouped by id (key-value pairs of a str and a Document)
    (tmp_path / "j.jsonl").write_text("".join(f'{{"id": "k{i % 7}", "text": "Doc {i}. It has two sentences."}}\n'
                                              for i in range(9)))
    args = ("--input-format", "jsonl", "--id-field", "id")
    jsonl = str(tmp_path / "j.jsonl")
    calls.clear()
    assert main(argv(tiny_model_files, jsonl, str(tmp_path / "jb"), *args)) == 0
    break_fusion(False)
    assert main(argv(tiny_model_files, jsonl, str(tmp_path / "jf"), *args)) == 0
    got, ref = read_output(str(tmp_path / "jb")), read_output(str(tmp_path / "jf"))
    assert_same_output(got, ref)
    assert got[0]["counts"]["dead_letters_by_reason"] == {"duplicate id": 4} and calls.get("Document", 0) >= 9
