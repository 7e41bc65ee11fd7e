"""The plain functions under the pipeline's Beam shells: the one batching rule (model.batching) as every front
end uses it, a document's sentences (transforms.sentences), a batch split at the window (transforms.embed_items),
and a compressed file's lines with its stored bytes counted (transforms.lines)."""
import gzip

from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.model.batching import embed_in_batches, plan_batches
from elmo_pipeline.tokenization import tokenize_document
from elmo_pipeline.transforms.embed_items import embedding_failed, split_at_window, window_limit
from elmo_pipeline.transforms.inference import embed_budgeted
from elmo_pipeline.transforms.lines import lines_until_corrupt, open_decompressed
from elmo_pipeline.transforms.records import Document, Item
from elmo_pipeline.transforms.sentences import document_reason, sentence_items


class _Recorder:
    """embed_batch that records each batch it gets and returns each sentence's length."""
    lanes = False

    def __init__(self):
        self.batches = []

    def embed_batch(self, sentences):
        self.batches.append([list(s) for s in sentences])
        return [len(s) for s in sentences]


def test_plan_batches_by_count_keeps_the_sorted_or_input_order():
    lengths = [5, 1, 4, 2, 3]
    assert plan_batches(lengths, max_sentences=2) == [[1, 3], [4, 2], [0]]
    assert plan_batches(lengths, sort=False, max_sentences=2) == [[0, 1], [2, 3], [4]]


def test_embed_in_batches_runs_the_plan_and_returns_input_order():
    sentences = [["a"] * n for n in (5, 1, 4, 2, 3)]
    rec = _Recorder()
    out = embed_in_batches(rec.embed_batch, sentences, plan_batches([5, 1, 4, 2, 3], 12))
    assert out == [5, 1, 4, 2, 3]
    assert [[len(s) for s in b] for b in rec.batches] == [[1, 2], [3, 4], [5]]     # n * (longest + 2) <= 12


def test_embed_budgeted_batches_as_plan_batches():
    sentences = [["w"] * n for n in (7, 3, 3, 9, 1, 4)]
    rec = _Recorder()
    assert embed_budgeted(rec, sentences, 16) == [7, 3, 3, 9, 1, 4]
    plan = plan_batches([len(s) for s in sentences], 16)
    assert [[len(s) for s in b] for b in rec.batches] == [[len(sentences[i]) for i in idx] for idx in plan]


def test_sentence_items_drops_long_sentences_and_shares_bytes():
    doc = Document("d", "One two three four. Five.", nbytes=25)
    outs = list(sentence_items(doc, tokenize_document(doc.text, "raw", True), max_tokens=3,
                               max_document_tokens=100, share_bytes=True))
    (letter, b0), (item, b1) = outs
    assert isinstance(letter, DeadLetter) and letter.id == "d#0"
    assert "5 tokens > --max-sentence-tokens 3" in letter.reason
    assert isinstance(item, Item) and item.id == "d#1" and item.tokens == ("Five", ".") and item.nbytes == b1
    assert b0 + b1 == 25


def test_a_document_over_its_token_cap_is_one_dead_letter_with_all_its_bytes():
    doc = Document("d", "a b c. d e.", nbytes=11)
    sentences = tokenize_document(doc.text, "whitespace", True)
    assert document_reason(sentences, 4).startswith("too long: document of 5 tokens")
    [(letter, nbytes)] = sentence_items(doc, sentences, 100, 4)
    assert letter.id == "d#0" and nbytes == 11
    assert document_reason("boom", 4) == "tokenizer failed: boom" and document_reason([], 4).startswith("no tokens")


def test_split_at_window_keeps_batch_order():
    items = [Item(f"d#{i}", "d", i, ("t",) * n, ()) for i, n in enumerate((3, 9, 2, 12))]
    assert window_limit(0, 100) is None and split_at_window(items, None) == (items, [])
    limit = window_limit(8, 100)
    assert limit == 8 and split_at_window(items, limit) == ([items[0], items[2]], [items[1], items[3]])
    assert window_limit(50, 20) == 18                      # capped so a window with <S> </S> fits the budget
    assert embedding_failed(items[0], RuntimeError("x")).reason == "embedding failed: RuntimeError: x"


def test_open_decompressed_counts_the_stored_bytes(tmp_path):
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress(b"one\ntwo\n"))
    with open_decompressed(str(path)) as (f, meter):
        assert list(lines_until_corrupt(f)) == [b"one", b"two"]
        assert meter.n == path.stat().st_size
