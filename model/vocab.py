"""A token vocabulary in bilm-tf's format: one token per line, <S> </S> <UNK> included."""
from __future__ import annotations

from typing import Iterable, Sequence

from elmo_pipeline.fsio import open_url

SPECIALS = ("<S>", "</S>", "<UNK>")


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
    def load(cls, url: str) -> "Vocabulary":
        with open_url(url, "rt", encoding="utf-8") as f:
            return cls([line.rstrip("\n") for line in f if line.rstrip("\n")])

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in self.tokens))
