"""A BiLM with the softmax its forward and backward LMs share, and exact held-out perplexity.

nll_sums(inputs, lengths, targets): summed negative log-likelihoods (nats) of both directions, computed
with the padded training forward pass (model/padded_forward.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.training.data import BatchMaker, Corpus, eval_batches
from elmo_pipeline.model.options import parse_options
from elmo_pipeline.model.padded_forward import top_layer
from elmo_pipeline.training.softmax import build_softmax
from elmo_pipeline.model.vocab import Vocabulary

class LMHead(nn.Module):
    """A BiLM plus the softmax both directions share. nll_sums(batch) -> (sum fwd, sum bwd) in nats."""

    def __init__(self, options: dict, vocab_size: int):
        super().__init__()
        self.opts = parse_options(options)
        self.bilm = BiLM(self.opts, dropout=float(options.get("dropout", 0.0)))
        self.softmax = build_softmax(options.get("softmax"), self.opts.projection_dim, vocab_size)

    def nll_sums(self, inputs: Tensor, lengths: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        top_f, top_b = top_layer(self.bilm, inputs, lengths)         # (B, T, P) each
        T = top_f.shape[1]
        # position t predicts t + 1 (forward) and t + 1 predicts t (backward), for t + 1 < length
        m = torch.arange(T - 1, device=top_f.device)[None, :] < (lengths.to(top_f.device)[:, None] - 1)
        fwd = self.softmax.nll(top_f[:, :-1][m], targets[:, 1:][m])
        bwd = self.softmax.nll(top_b[:, 1:][m], targets[:, :-1][m])
        return fwd.sum(), bwd.sum()


def build_model(options: dict, vocab: Vocabulary) -> LMHead:
    options = dict(options)
    options["n_tokens_vocab"] = len(vocab)
    return LMHead(options, len(vocab))


@dataclass
class Perplexity:
    loss_fwd: float
    loss_bwd: float
    n_tokens: int

    @property
    def ppl_fwd(self) -> float:
        return math.exp(self.loss_fwd)

    @property
    def ppl_bwd(self) -> float:
        return math.exp(self.loss_bwd)

    @property
    def ppl_mean(self) -> float:
        """exp of the mean of both directions' losses (the geometric mean of the two perplexities)."""
        return math.exp((self.loss_fwd + self.loss_bwd) / 2)

    def as_dict(self) -> dict:
        return {"ppl_fwd": self.ppl_fwd, "ppl_bwd": self.ppl_bwd, "ppl_mean": self.ppl_mean,
                "loss_fwd": self.loss_fwd, "loss_bwd": self.loss_bwd, "n_tokens": self.n_tokens}


@torch.no_grad()
def evaluate(head: LMHead, corpus: Corpus, batch_size: int = 64, max_windows: int | None = None) -> Perplexity:
    """Exact perplexities of both directions over every window of `corpus` (state starts at zero per window)."""
    was_training = head.training
    head.eval()
    maker = batch_maker(head, corpus)
    lengths = corpus.lengths if max_windows is None else corpus.lengths[:max_windows]
    sf = sb = 0.0
    n = 0
    for ids in eval_batches(lengths, batch_size):
        b = maker(ids)
        f, bw = head.nll_sums(b.inputs, b.lengths, b.targets)
        sf, sb, n = sf + float(f), sb + float(bw), n + b.n_predicted
    head.train(was_training)
    return Perplexity(sf / max(n, 1), sb / max(n, 1), n)


def _max_chars(head: LMHead) -> int:
    return head.opts.max_characters_per_token if head.opts.char_cnn is not None else 50


def batch_maker(head: LMHead, corpus: Corpus) -> BatchMaker:
    char = head.opts.char_cnn is not None
    return BatchMaker(corpus, char, _max_chars(head), max(w for w, _ in head.opts.filters) if char else None)
