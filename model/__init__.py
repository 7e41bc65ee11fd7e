"""The ELMo biLM in plain PyTorch (no Beam): load, run, save, mix.

    from elmo_pipeline.model import ElmoEmbedder
    e = ElmoEmbedder("options.json", "weights.hdf5")          # or ElmoEmbedder() for the shipped model
    vectors = e.embed_sentence(["The", "cat", "sat", "."])   # (3, 4, 2P) float32
"""
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.char_ids import batch_char_ids, sentence_char_ids, token_char_ids
from elmo_pipeline.model.embedder import STATE_MODES, ElmoEmbedder
from elmo_pipeline.model.options import BiLMOptions, OptionsError, load_options, parse_options
from elmo_pipeline.model.scalar_mix import ScalarMix
from elmo_pipeline.model.weights import WeightsError, load_bilm, save_bilm

__all__ = ["BiLM", "BiLMOptions", "ElmoEmbedder", "OptionsError", "STATE_MODES", "ScalarMix",
           "WeightsError", "batch_char_ids", "load_bilm", "load_options", "parse_options",
           "save_bilm", "sentence_char_ids", "token_char_ids"]
