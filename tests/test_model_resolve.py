"""model/resolve.py: one choice of model (a name, options + weight files, or nothing) -> its files and name."""
import json

import pytest

from elmo_pipeline.fsio import file_sha256
from elmo_pipeline.model.pretrained import DEFAULT_MODEL, model_files
from elmo_pipeline.model.resolve import CUSTOM, resolve_model


def test_nothing_given_is_the_shipped_default():
    m = resolve_model()
    assert (m.name, m.model_name, m.tokenization) == (DEFAULT_MODEL, DEFAULT_MODEL, "wikitext")
    assert (m.options_file, m.weight_file, m.vocab_file) == model_files(DEFAULT_MODEL)
    assert m.local_files() == model_files(DEFAULT_MODEL)


def test_files_given_are_custom_and_keep_their_vocabulary(tiny_model_files, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\n")
    m = resolve_model(None, *tiny_model_files, str(vocab))
    assert (m.name, m.model_name, m.tokenization) == (CUSTOM, None, None)
    assert m.local_files() == (*tiny_model_files, str(vocab))
    identity = m.identity()
    assert identity["weights_sha256"] == file_sha256(tiny_model_files[1])
    assert identity["options"] == json.load(open(tiny_model_files[0]))
    assert (identity["options_file"], identity["weight_file"], identity["vocab_file"]) == (*tiny_model_files, str(vocab))


def test_a_named_model_takes_a_given_vocabulary(tmp_path):
    vocab = str(tmp_path / "vocab.txt")
    open(vocab, "w").write("<S>\n</S>\n<UNK>\n")
    assert resolve_model(DEFAULT_MODEL, vocab_file=vocab).vocab_file == vocab


@pytest.mark.parametrize("name,options,weights", [("small", "o.json", "w.hdf5"), (None, "o.json", None),
                                                   (None, None, "w.hdf5")])
def test_files_and_a_name_or_half_the_files_are_refused(name, options, weights):
    with pytest.raises(ValueError, match="together, or --model NAME, not both"):
        resolve_model(name, options, weights)


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="no model named 'nope'"):
        resolve_model("nope")
