"""A token vocabulary in bilm-tf's format: one token per line, <S> </S> <UNK> included."""
from __future__ import annotations

from typing import Iterable, Sequence

from elmo_pipeline.fsio import atomic_write, bounded_lines, open_url, url_fs

SPECIALS = ("<S>", "</S>", "<UNK>")
MAX_TOKEN_CHARS = 1 << 16     # a vocabulary line (one token) is at most this long


class Vocabulary:
    def __init__(self, tokens: Sequence[str]):
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        missing = [s for s in SPECIALS if s not in self.index]
        if missing:
            raise ValueError(f"vocabulary lacks the special tokens {missing}")
        self.unk = self.index["<UNK>"]

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        return [self.index.get(t, self.unk) for t in tokens]

    @classmethod
    def load(cls, url: str, size: int | None = None) -> "Vocabulary":
        """The vocabulary file at `url`: ValueError at a line over MAX_TOKEN_CHARS (never read whole) or, with
        `size` (the model's n_tokens_vocab), more tokens than the model's embedding has rows."""
        tokens = []
        with open_url(url, "rt", encoding="utf-8") as f:
            for token in bounded_lines(f, MAX_TOKEN_CHARS, url):
                if token:
                    tokens.append(token)
                if size is not None and len(tokens) > size:
                    raise ValueError(f"{url}: more than the model's n_tokens_vocab {size} tokens")
        return cls(tokens)

    def save(self, path: str) -> None:
        """One token a line at the local `path`, whole, only over nothing or a regular file (fsio.atomic_write)."""
        atomic_write(url_fs(path)[0], path, "".join(t + "\n" for t in self.tokens).encode("utf-8"), files_only=True)
