import numpy as np

from model.char_ids import batch_char_ids, sentence_char_ids, token_char_ids


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
