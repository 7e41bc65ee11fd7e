import numpy as np

from elmo_pipeline.model.char_ids import batch_char_ids, sentence_char_ids, token_char_ids


def test_word_ids_match_reference_layout():
    ids = token_char_ids("cat")
    # +1 shifted: begin-of-word 258, bytes, end-of-word 259, padding 260
    assert ids[:5].tolist() == [259, ord("c") + 1, ord("a") + 1, ord("t") + 1, 260]
    assert (ids[5:] == 261).all() and ids.shape == (50,)


def test_boundary_tokens():
    assert token_char_ids("<S>")[:4].tolist() == [259, 257, 260, 261]
    assert token_char_ids("</S>")[:4].tolist() == [259, 258, 260, 261]


def test_utf8_bytes_and_truncation():
    ids = token_char_ids("é")
    assert ids[1:3].tolist() == [0xC3 + 1, 0xA9 + 1]
    long = token_char_ids("x" * 80)
    assert long[0] == 259 and long[49] == 260 and (long[1:49] == ord("x") + 1).all()


def test_batch_padding_is_zero():
    ids, lengths = batch_char_ids([["a"], ["a", "b", "c"], []])
    assert lengths.tolist() == [3, 5, 2]
    assert ids.shape == (3, 5, 50)
    assert (ids[0, 3:] == 0).all() and (ids[2, 2:] == 0).all()
    np.testing.assert_array_equal(ids[1, :5], sentence_char_ids(["a", "b", "c"]))


def test_vectorized_ids_equal_per_token_ids_and_torch_unique_order():
    """batch_char_ids (built per distinct token, vectorized) equals the per-token reference layout, and
    distinct_char_ids' rows are torch.unique(dim=0)'s, in its order: the biLM's char CNN then sees the very
    same rows (long, multi-byte, empty, lone-surrogate and literal <S> tokens included)."""
    import random

    import torch

    from elmo_pipeline.model.char_ids import distinct_char_ids
    rng = random.Random(0)
    pieces = ["a", "b", "é", "日本", "<S>", "</S>", "x" * 60, "y" * 47 + "é", "😀", "\ud800", "", "ab", "Ab", "\x00"]
    for _ in range(200):
        sents = [[rng.choice(pieces) + rng.choice(pieces) for _ in range(rng.randint(0, 7))]
                 for _ in range(rng.randint(1, 5))]
        ids, lengths = batch_char_ids(sents)
        per = [sentence_char_ids(s) for s in sents]
        assert lengths.tolist() == [len(p) for p in per]
        for b, p in enumerate(per):
            np.testing.assert_array_equal(ids[b, : len(p)], p)
            assert not ids[b, len(p):].any()
        uniq, index, _ = distinct_char_ids(sents)
        rows = torch.from_numpy(np.concatenate(per))
        np.testing.assert_array_equal(uniq, torch.unique(rows, dim=0).numpy())
        np.testing.assert_array_equal(uniq[index[index >= 0]], np.concatenate(per))
