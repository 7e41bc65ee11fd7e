"""Sentence splitting and word tokenization with character offsets (tokenization/tokenizers.py).

Used by the pipeline (transforms/dofns.py) and by language-model training (training/data.py); imports
neither Beam nor torch.
"""
from tokenization.tokenizers import (TOKENIZERS, Sentence, align_tokens, moses_tokens, tokenize_document,
                                     tokenize_text)

__all__ = ["Sentence", "TOKENIZERS", "align_tokens", "moses_tokens", "tokenize_document", "tokenize_text"]
