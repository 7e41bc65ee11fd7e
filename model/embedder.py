"""Embed tokenized sentences with a biLM: AllenNLP's ElmoEmbedder API, plus three state modes.

State modes (what each sentence's LSTMs start from):
  stateless  zeros. A sentence's vectors depend on nothing but the sentence. DEFAULT.
  warm       one fixed state, computed once by running WARMUP_TEXT through the model. Just as
             deterministic; closer to the carried-over state the model saw in training.
  stateful   each batch row carries its state over to the same row of the next batch, exactly like
             bilm-tf / AllenNLP (batches are consecutive input sentences, never reordered). For parity
             and compatibility only: results depend on batch size and on what came before.

batch_invariant=True (stateless and warm; off by default for its cost in speed:
docs/decisions/batch-invariant-cost.md): a sentence's vectors are the same bits whatever it is batched with
(alone, in any batch size or order, any token budget), at a given torch thread count (and, measured, the same
at 1 and 2 threads): BiLM.forward_tokens(batch_invariant=True). False (default): the fast
path, equal up to float rounding (a few ulps). Stateful mode always runs the fast path.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from elmo_pipeline.model.batching import embed_in_batches, plan_batches
from elmo_pipeline.model.bilm import BiLM
from elmo_pipeline.model.char_ids import BOS_TOKEN, EOS_TOKEN, distinct_char_ids
from elmo_pipeline.model.device import check_batch_invariant, host_side, resolve_device, to_host
from elmo_pipeline.model.hardware import warn_if_emulated
from elmo_pipeline.model.options import COMPUTE_DTYPES, STATE_MODES, sentences_independent

# Fixed warm-up text for the `warm` mode: ordinary English, run sentence by sentence from zeros.
WARMUP_TEXT = [
    "The first time I saw the city , it was early in the morning and the streets were still empty .",
    "She said that the report would be published next week , after the committee had met .",
    "In 1998 , the company moved its headquarters to a larger building near the river .",
    "It is not clear whether the new rules will change anything for most people .",
    "He played for the team for six seasons before he retired .",
]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or the torch dtype) -> torch dtype; anything else is an error."""
    name = str(dtype).removeprefix("torch.")
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
    return getattr(torch, name)


class ElmoEmbedder:
    """Per-sentence ELMo vectors: float32 arrays (n_layers + 1, T, 2P). token_cache: how many distinct
    tokens' char-CNN vectors to keep across batches (0: none). dtype: the precision the biLM runs in
    (float32, exact; bfloat16/float16 within 1e-2 relative error per layer, faster only where the hardware runs
    them natively: GPUs, CPUs with AVX512_BF16/AMX for bfloat16; model.hardware, docs/exactness.md); results are
    float32 either way; None: a given `model` keeps its own, a loaded one runs in float32.

    Layer 0 is the token vector duplicated to 2P (AllenNLP compatible); layer k the concatenated
    forward and backward outputs of LSTM layer k. <S> and </S> are added and removed internally.

    batch_invariant: True = every sentence's vectors are bit-identical whatever the batching (module docstring;
    stateless and warm only: stateful results depend on the batches by design); False (default): the fast path.

    lanes: a batch's sentences laid end to end in the LSTMs' lanes, each from the initial state again
    (model.packing.PackedBatch): the loop runs nearly every lane at every step instead of a tail of steps with the
    longest sentences alone. None (default): on in stateless and warm modes (off in stateful, which needs each
    sentence's final state); the same vectors up to float rounding, bit-identical with batch_invariant.

    lstm_loop: the LSTM loop the model runs, 'auto', 'onednn' or 'bmm' (BiLM.lstm_loop, model/lstm.py); None
    (default): the model's own (ELMO_LSTM_GEMM when it was constructed, else 'auto'). Set on the model.

    weights_sha256: the weight file must have this SHA-256 (WeightsError otherwise); the model is then built from
    the very bytes hashed (a pipeline worker passes the digest its run was planned with).
    """

    def __init__(self, options_file: str | None = None, weight_file: str | None = None, *,
                 device: str | int | torch.device | None = "cpu", state: str = "stateless",
                 batch_size: int = 64, model: BiLM | None = None, vocab_file: str | None = None,
                 token_cache: int = 50_000, dtype: str | torch.dtype | None = None,
                 batch_invariant: bool = False, lanes: bool | None = None, lstm_loop: str | None = None,
                 weights_sha256: str | None = None):
        if state not in STATE_MODES:
            raise ValueError(f"state must be one of {STATE_MODES}, got {state!r}")
        if batch_invariant and state == "stateful":
            raise ValueError("batch_invariant needs state='stateless' or 'warm' (stateful results depend on the batches)")
        self.batch_invariant = bool(batch_invariant)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = resolve_device(device)
        if self.batch_invariant:
            check_batch_invariant(self.device)
        if model is None:
            from elmo_pipeline.model.weights import load_bilm
            if options_file is None or weight_file is None:      # both or neither: resolve_model checks
                from elmo_pipeline.model.resolve import resolve_model
                default = resolve_model(None, options_file, weight_file, vocab_file)
                options_file, weight_file, vocab_file = default.options_file, default.weight_file, default.vocab_file
            model = load_bilm(options_file, weight_file, sha256=weights_sha256)
        # dtype None: a given model keeps its own precision, a loaded one runs in float32
        self.dtype = resolve_dtype(dtype) if dtype is not None else next(model.parameters()).dtype
        moved = any(t.device != self.device or (t.is_floating_point() and t.dtype != self.dtype)
                    for t in (*model.parameters(), *model.buffers()))
        self.model = (model.to(self.device, self.dtype) if moved else model).eval()
        if lstm_loop is not None:
            self.model.lstm_loop = lstm_loop
        warn_if_emulated(self.dtype, self.device)    # once per process: an emulated dtype is slower than float32
        if self.model.opts.char_cnn is not None:   # char-CNN vectors of up to `token_cache` distinct tokens are reused
            self.model.enable_token_cache(token_cache)
        self.state_mode = state
        if lanes and not sentences_independent(state):
            raise ValueError("lanes need state='stateless' or 'warm' (stateful carries each sentence's final state)")
        self.lanes = sentences_independent(state) if lanes is None else bool(lanes)
        self.batch_size = batch_size
        self.vocab = None
        if self.model.opts.char_cnn is None:
            if vocab_file is None:
                raise ValueError("a word-encoder biLM needs its vocabulary: pass vocab_file")
            from elmo_pipeline.model.vocab import Vocabulary
            self.vocab = Vocabulary.load(vocab_file, self.model.opts.n_tokens_vocab)
        self.model_name: str | None = None      # set by from_name()
        self.tokenization: str | None = None    # the model's training-text tokenization (from_name())
        self._carried: tuple[torch.Tensor, torch.Tensor] | None = None   # stateful: per-row state
        self._warm: tuple[torch.Tensor, torch.Tensor] | None = None
        if state == "warm":
            self._warm = self._compute_warm_state()

    @classmethod
    def from_name(cls, name: str, progress: bool | None = None, **kwargs) -> "ElmoEmbedder":
        """An embedder of a model by name (model.pretrained.MODELS: the shipped one, or a published one,
        downloaded into the cache on first use and verified on every use); kwargs as for the constructor.
        Its `model_name` and `tokenization` (the scheme of its training text) are set."""
        from elmo_pipeline.model.resolve import resolve_model
        return cls.from_model(resolve_model(name, progress=progress), **kwargs)

    @classmethod
    def from_model(cls, model, **kwargs) -> "ElmoEmbedder":
        """An embedder of a model.resolve.ModelSpec (its files as given: paths or URLs); kwargs as for the
        constructor. Its `model_name` and `tokenization` are set (None for custom files)."""
        embedder = cls(model.options_file, model.weight_file, vocab_file=model.vocab_file, **kwargs)
        embedder.model_name, embedder.tokenization = model.model_name, model.tokenization
        return embedder

    @property
    def output_dim(self) -> int:
        return self.model.output_dim

    @property
    def n_layers(self) -> int:
        return self.model.n_layers + 1

    # --- inputs -----------------------------------------------------------------------------
    def batch_inputs(self, sentences: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model inputs with <S> ... </S> added, as distinct tokens and an index into them (BiLM.forward_tokens):
        uniq (U, max_chars) char ids or (U,) word ids, index (B, T+2) int64 (-1 at padding), lengths (B,); all on the host (CPU tensors)."""
        if self.vocab is not None:
            ids = [self.vocab.encode([BOS_TOKEN, *s, EOS_TOKEN]) for s in sentences]
            lengths = np.array([len(i) for i in ids], dtype=np.int64)
            uniq, inverse = np.unique(np.fromiter((t for i in ids for t in i), dtype=np.int64), return_inverse=True)
            index = np.full((len(ids), int(lengths.max())), -1, dtype=np.int64)
            index[np.arange(index.shape[1])[None, :] < lengths[:, None]] = inverse
        else:
            uniq, index, lengths = distinct_char_ids(sentences, self.model.opts.max_characters_per_token)
        # host data: the model sends what its device needs in one copy (BiLM.prepare_tokens)
        with host_side():
            return torch.from_numpy(uniq), torch.from_numpy(index), torch.from_numpy(lengths)

    # --- states -----------------------------------------------------------------------------
    def reset_states(self) -> None:
        """Forget the carried state (stateful mode)."""
        self._carried = None

    def _compute_warm_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        state = None
        for sentence in WARMUP_TEXT:
            _, state = self._forward([sentence.split()], state)
        return state

    def _initial_state(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.state_mode == "stateless":
            return None
        if self.state_mode == "warm":
            h, c = self._warm
            return h.expand(-1, -1, batch_size, -1), c.expand(-1, -1, batch_size, -1)
        # stateful, as AllenNLP: rows beyond what was carried start from zeros
        zh, zc = self.model.zero_state(batch_size, self.device)
        if self._carried is not None:
            h, c = self._carried
            n = min(batch_size, h.shape[2])
            zh[:, :, :n], zc[:, :, :n] = h[:, :, :n], c[:, :, :n]
        return zh, zc

    def _keep_state(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        h, c = state
        if self._carried is None or self._carried[0].shape[2] <= h.shape[2]:
            self._carried = (h, c)
        else:  # a smaller batch updates its rows; rows beyond keep their older state
            ch, cc = (t.clone() for t in self._carried)
            ch[:, :, : h.shape[2]], cc[:, :, : h.shape[2]] = h, c
            self._carried = (ch, cc)

    # --- running ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, sentences, state, layers: Sequence[int] | None = None, prepared=None):
        """(L+1, N, 2P) for the real tokens of `sentences` (only `layers`, ascending, when given), and the final
        state (BiLM.forward_tokens)."""
        inputs = self.batch_inputs(sentences) if prepared is None else (None, None, None)
        return self.model.forward_tokens(*inputs, state, batch_invariant=self.batch_invariant, layers=layers,
                                         prepared=prepared, lanes=self.lanes)

    @torch.inference_mode()
    def prepare_packed(self, sentences: Sequence[Sequence[str]]):
        """embed_packed's order-dependent first part (char ids and token vectors through the token cache,
        BiLM.prepare_tokens), for embed_packed(sentences, layers, prepared=...). Calls in a fixed order on one
        thread, then embed_packed on several threads at once, give the vectors of calls one after another
        (stateless and warm; stateful carries state from batch to batch: one thread). None for no sentences."""
        if not sentences:
            return None
        return self.model.prepare_tokens(*self.batch_inputs(sentences), batch_invariant=self.batch_invariant,
                                         lanes=self.lanes)

    def embed_packed(self, sentences: Sequence[Sequence[str]], layers: Sequence[int] | None = None, prepared=None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """One batch, as given, packed: float32 (n_layers+1, N, 2P) for its N tokens, sentence after sentence
        (each layer one contiguous (N, 2P) block; no padding, no copy per sentence), and offsets (B+1,) int64:
        sentence b is [:, offsets[b]:offsets[b+1]]. layers (ascending): only these, (len(layers), N, 2P), the
        same values; the others are computed but not copied out. prepared: prepare_packed(sentences). On a GPU the
        array lives in page-locked host memory, back in torch's cache once freed (model.device.to_host)."""
        sentences = [list(s) for s in sentences]
        offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in sentences], out=offsets[1:])
        if not sentences:
            n = self.n_layers if layers is None else len(layers)
            return np.zeros((n, 0, self.output_dim), np.float32), offsets
        out, state = self._forward(sentences, self._initial_state(len(sentences)), layers, prepared)
        if self.state_mode == "stateful":
            self._keep_state(state)
        return to_host(out), offsets

    def embed_batch(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """One batch, as given. Returns one float32 array (n_layers+1, T_i, 2P) per sentence."""
        out, offsets = self.embed_packed(sentences)
        # copies, never the batch's block (on a GPU page-locked memory, to be reused): also for a one-sentence batch
        return [np.array(out[:, a:b], order="C") for a, b in zip(offsets[:-1], offsets[1:])]

    def embed_sentence(self, tokens: Sequence[str]) -> np.ndarray:
        """(n_layers+1, T, 2P) for one sentence; T = 0 for an empty one."""
        return self.embed_batch([tokens])[0]

    def embed_sentences(self, sentences: Iterable[Sequence[str]], batch_size: int | None = None,
                        max_tokens: int | None = None) -> Iterator[np.ndarray]:
        """Arrays for an iterable of sentences, in input order.

        Stateful: consecutive batches of batch_size in input order. Otherwise results do not depend on
        batching, so sentences are length-sorted within a window of 16 batches to cut padding; with
        max_tokens, batches are cut by a token budget (token slots, <S> </S> included; lanes) instead of a
        count: on a CPU, budgets of 8k-16k tokens run the LSTMs' GEMMs much faster than 64 sentences."""
        bs = batch_size or self.batch_size
        if max_tokens is not None and self.state_mode == "stateful":
            raise ValueError("max_tokens batches are length-sorted: not available in stateful mode")
        buf: list[list[str]] = []
        slots = 0
        for s in sentences:
            buf.append(list(s))
            slots += len(buf[-1]) + 2
            full = (slots >= 16 * max_tokens) if max_tokens else len(buf) == (bs if self.state_mode == "stateful" else 16 * bs)
            if full:
                yield from self._embed_window(buf, bs, max_tokens)
                buf, slots = [], 0
        if buf:
            yield from self._embed_window(buf, bs, max_tokens)

    def _embed_window(self, sents: list[list[str]], bs: int, max_tokens: int | None = None) -> list[np.ndarray]:
        lengths = [len(s) for s in sents]
        batches = plan_batches(lengths, max_tokens, lanes=self.lanes) if max_tokens else \
            plan_batches(lengths, sort=self.state_mode != "stateful", max_sentences=bs)
        return embed_in_batches(self.embed_batch, sents, batches)
