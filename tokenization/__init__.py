"""Sentence splitting and word tokenization with character offsets (tokenization/tokenizers.py).

Used by the pipeline (transforms/tokenize_step.py) and by language-model training (training/data.py); imports
neither Beam nor torch.
"""
from elmo_pipeline.tokenization.tokenizers import (RAW_SCHEMES, TOKENIZERS, Sentence, align_tokens, moses_tokens, resolve_tokenizer,
                                     tokenize_document, tokenize_text, tokenizer_version)

__all__ = ["RAW_SCHEMES", "Sentence", "TOKENIZERS", "align_tokens", "moses_tokens", "resolve_tokenizer",
           "tokenize_document", "tokenize_text", "tokenizer_version"]
