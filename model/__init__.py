"""The ELMo biLM in plain PyTorch (no Beam): load, run, save, mix.

    from model import ElmoEmbedder
    e = ElmoEmbedder("options.json", "weights.hdf5")          # or ElmoEmbedder() for the shipped model
    vectors = e.embed_sentence(["The", "cat", "sat", "."])   # (3, 4, 2P) float32
"""
from model.bilm import BiLM
from model.char_ids import batch_char_ids, sentence_char_ids, token_char_ids
from model.embedder import STATE_MODES, ElmoEmbedder
from model.options import BiLMOptions, OptionsError, load_options, parse_options
from model.scalar_mix import ScalarMix
from model.weights import WeightsError, load_bilm, save_bilm

__all__ = ["BiLM", "BiLMOptions", "ElmoEmbedder", "OptionsError", "STATE_MODES", "ScalarMix",
           "WeightsError", "batch_char_ids", "load_bilm", "load_options", "parse_options",
           "save_bilm", "sentence_char_ids", "token_char_ids"]
