"""The ELMo biLM (Peters et al. 2018) in plain PyTorch, in bilm-tf's conventions.

token encoder (model/encoders.py: char CNN + highway + projection, or a word-embedding table)
  -> n_layers LSTMs with cell clip, projection and projection clip, per direction (model/lstm.py)
  -> per layer: concat(forward, backward)

Parameters are stored in bilm-tf's own layout (gate order, carry gate, forget bias at run time),
so loading and saving the published HDF5 files is a transpose and nothing else (model/weights.py).

Without autograd, sequences run in a packed layout (model/packing.py: time-major, longest first), in place:
each LSTM layer's input projection is one GEMM over the real tokens only, the time loop touches only sentences
still running, and every sentence's result is independent of the others in its batch. With lanes (the
embedder's stateless and warm modes) a batch's sentences run end to end in the loop's rows, each from the
initial state again, so nearly every row runs at every step. Under autograd (training) BiLM.forward runs the
padded path of model/padded_forward.py instead: the same math, faster backward passes.

batch_invariant=True (inference; forward, forward_tokens, encode_tokens): a sentence's vectors are the same
bits whatever else is in its batch. A CPU GEMM's kernel, and so a row's bits, follow the call's row count (1-3
rows take another kernel everywhere measured); so every GEMM gets a multiple of ROW_TILE rows, and on a CPU only
row counts its RowRule checked in this process to give each row the bits of a ROW_TILE-row call at 1 thread
(model/row_tile.py): the token encoder's inputs are padded with all-padding tokens, and the LSTMs run in a padded
packed layout where step t has round_up(n_t, ROW_TILE) rows (the extra rows get zero inputs; they are computed
and thrown away). Highway's sigmoid is exp(-x) + 1 -> reciprocal, whose
vector and scalar code agree. See docs/exactness.md.

The LSTM loop (BiLM.lstm_loop, one of LSTM_LOOPS; model/lstm.py) and whether a GPU compiles the LSTM cell
(BiLM.compile_cell) are options of the model, read when it runs; their defaults come from the environment
variables ELMO_LSTM_GEMM and ELMO_COMPILE_CELL, read when the model is constructed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo_pipeline.model import onednn
from elmo_pipeline.model.device import host_side, upload
from elmo_pipeline.model.encoders import CharCNNEncoder, WordEncoder
from elmo_pipeline.model.lstm import LstmProjection, StepLoop, check_loop_choice, options_from_env, run_lstm_layers, step_loop
from elmo_pipeline.model.options import BiLMOptions
from elmo_pipeline.model.packing import PackedBatch
from elmo_pipeline.model.padded_forward import padded_forward
from elmo_pipeline.model.token_cache import TokenCache


class BiLM(nn.Module):
    """The bidirectional LM. forward(inputs, lengths, state) -> (layers, state).

    inputs: (B, T, max_chars) char ids (char CNN) or (B, T) token ids (word encoder), boundary
    tokens <S> </S> included, 0 at padded positions; lengths (B,) >= 1.
    layers: (n_layers + 1, B, T, 2P): [0] the token vectors duplicated, [k] concat(fwd_k, bwd_k);
    zeros at padded positions.
    state: (h, c) with h (2, n_layers, B, P), c (2, n_layers, B, H) in batch-row order; index 0 is the
    forward direction. None means zeros. The returned state is each row's state after its sequence.
    Without autograd: the packed in-place path below; with autograd: model/padded_forward.py.
    """

    def __init__(self, opts: BiLMOptions, dropout: float = 0.0, *, lstm_loop: str | None = None,
                 compile_cell: bool | None = None):
        """lstm_loop: the inference LSTM loop, one of LSTM_LOOPS ('auto', 'onednn', 'bmm'; model/lstm.py);
        None: $ELMO_LSTM_GEMM, else 'auto'. compile_cell: the bmm loop's cell as one torch.compile'd kernel on a
        GPU; None: True unless $ELMO_COMPILE_CELL is '0'. Both may be set on the model later."""
        super().__init__()
        self.opts = opts
        self.dropout = dropout
        env_loop, env_compile = options_from_env()
        self.lstm_loop = env_loop if lstm_loop is None else lstm_loop
        self.compile_cell = env_compile if compile_cell is None else compile_cell
        self.token_encoder = CharCNNEncoder(opts) if opts.char_cnn is not None else WordEncoder(opts)
        P, H = opts.projection_dim, opts.lstm_dim

        def stack():
            return nn.ModuleList(LstmProjection(P, H, P, opts.cell_clip, opts.proj_clip) for _ in range(opts.n_layers))

        self.forward_layers = stack()
        self.backward_layers = stack()

    @property
    def lstm_loop(self) -> str:
        """The inference LSTM loop: one of LSTM_LOOPS ('auto' picks per device and dtype, model.lstm.step_loop)."""
        return self.__dict__["_lstm_loop"]

    @lstm_loop.setter
    def lstm_loop(self, choice: str) -> None:
        self.__dict__["_lstm_loop"] = check_loop_choice(choice)

    @property
    def n_layers(self) -> int:
        return self.opts.n_layers

    @property
    def output_dim(self) -> int:
        return self.opts.output_dim

    def zero_state(self, batch_size: int, device=None, dtype=None) -> tuple[Tensor, Tensor]:
        p = next(self.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        L, P, H = self.opts.n_layers, self.opts.projection_dim, self.opts.lstm_dim
        return (torch.zeros(2, L, batch_size, P, device=device, dtype=dtype),
                torch.zeros(2, L, batch_size, H, device=device, dtype=dtype))

    def encode_tokens(self, inputs: Tensor, batch_invariant: bool = False) -> Tensor:
        """Token vectors for (N, max_chars) char ids or (N,) token ids -> (N, P).
        On the CPU the encoder runs once per distinct token: repeated words cost nothing extra. On another
        device every row is encoded: finding the distinct rows there is a host sync (a data-dependent count),
        so the host-side dedup is forward_tokens' (its inputs arrive as host data)."""
        if inputs.shape[0] == 0:
            return inputs.new_zeros((0, self.opts.projection_dim), dtype=next(self.parameters()).dtype)
        if inputs.device.type != "cpu":
            return self.token_encoder(inputs, batch_invariant)
        uniq, inverse = torch.unique(inputs, dim=0, return_inverse=True)
        return self._encode_distinct(uniq, batch_invariant)[inverse]

    def _encode_distinct(self, uniq: Tensor, batch_invariant: bool = False) -> Tensor:
        """(U, ...) distinct token inputs -> (U, P), through the token cache when one is enabled (inference)."""
        cache = self.__dict__.get("token_cache")
        if cache is None or torch.is_grad_enabled():
            return self.token_encoder(uniq, batch_invariant)
        keys, missing, hits = cache.lookup(uniq, self.token_encoder, batch_invariant)
        with host_side():
            at = {"missing": torch.tensor(missing, dtype=torch.int64), "hits": torch.tensor(hits, dtype=torch.int64)}
        at = upload(at, uniq.device)
        return cache.assemble(keys, missing, hits, uniq.index_select(0, at["missing"]) if hits else uniq,
                              at["missing"], at["hits"], self.token_encoder, batch_invariant)

    def enable_token_cache(self, max_tokens: int) -> None:
        """Keep the vectors of up to max_tokens distinct tokens across batches (inference only).
        The first max_tokens distinct tokens seen are kept; in Zipfian text these are the frequent ones."""
        self.__dict__["token_cache"] = TokenCache(max_tokens) if max_tokens > 0 else None

    def _pair_weights(self, k: int) -> tuple[StepLoop, object]:
        """Layer k's step loop (step_loop() for its device, dtype and shape, self.lstm_loop, self.compile_cell) and its two
        directions' weights in that loop's form, cached (re-made only when the options or a parameter change:
        its storage or in-place version counter)."""
        layers = [self.forward_layers[k], self.backward_layers[k]]
        w = layers[0].w_rec
        key = (self.lstm_loop, self.compile_cell,
               *onednn.params_key(p for l in layers for p in (l.w_in, l.w_rec, l.bias, l.w_proj)))
        cache = self.__dict__.setdefault("_weight_cache", {})
        if k not in cache or cache[k][0] != key:
            cache.pop(k, None)            # the old form's memory first (the original's weights are about 290 MB)
            loop = step_loop(w.device, w.dtype, self.lstm_loop, self.compile_cell, layers[0])
            cache[k] = (key, (loop, loop.weights(layers)))
        return cache[k][1]

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle: without the loops' cached weights (oneDNN's packed ones cannot be copied;
        they are made again on first use)."""
        state = self.__dict__.copy()
        state.pop("_weight_cache", None)
        return state

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(self, inputs: Tensor, lengths: Tensor, state: tuple[Tensor, Tensor] | None = None,
                batch_invariant: bool = False):
        """batch_invariant (inference only; ignored under autograd): each row's result in the same bits
        whatever the other rows (see the module docstring)."""
        if torch.is_grad_enabled():
            return padded_forward(self, inputs, lengths, state)
        B, T = inputs.shape[:2]
        pb = PackedBatch(lengths, T, inputs.device, batch_invariant=batch_invariant)
        emb = self.encode_tokens(inputs.reshape(B * T, *inputs.shape[2:]).index_select(0, pb.fwd_index),
                                 batch_invariant)                                                   # (N, P)
        out = emb.new_zeros(self.opts.n_layers + 1, B * T, 2 * emb.shape[-1])     # zeros at padded positions
        state = self._run_layers(emb, pb, state, out, pb.fwd_index, pb.bwd_index, batch_invariant)
        return out.view(-1, B, T, out.shape[-1]), state

    def prepare_tokens(self, uniq: Tensor, index: Tensor, lengths: Tensor, batch_invariant: bool = False,
                       lanes: bool = False) -> tuple[PackedBatch, Tensor]:
        """forward_tokens' first part: the packed layout and the token vectors emb (N_packed, P), through the token
        cache. Its bits depend on the order of calls (the cache keeps the vectors of the batch that first had a
        token): calls in a fixed order, then forward_tokens(..., prepared=) on any thread, give the same vectors
        as calls one after another (inference).

        Host data in, one copy: uniq, index and lengths on the host (CPU tensors, as ElmoEmbedder.batch_inputs
        gives them) are looked up in the token cache and laid out there, and what the device needs (the char ids
        of the tokens not cached, the index maps) goes to the model's device in ONE host-to-device copy. uniq and
        index already on the device also work (index is then read back to the host: a sync).

        lanes: sentences laid end to end in the LSTMs' lanes (PackedBatch): faster where a batch's lengths differ,
        for sentences that all start from the same state (stateless, warm); forward_tokens then returns no state."""
        B, T = index.shape
        device = next(self.parameters()).device
        cache = self.__dict__.get("token_cache")
        cache = None if torch.is_grad_enabled() else cache
        on_host = uniq.device.type == "cpu"
        keys, missing, hits = cache.lookup(uniq, self.token_encoder, batch_invariant) if cache else (None, [], [])

        def extra(fwd: Tensor) -> dict[str, Tensor]:
            more = {"inverse": index.to("cpu").reshape(B * T)[fwd]}
            if hits:
                more["missing_at"] = torch.tensor(missing, dtype=torch.int64)
                more["hits_at"] = torch.tensor(hits, dtype=torch.int64)
            if on_host and device.type != "cpu":        # only the char ids of tokens not cached travel
                more["uniq"] = uniq[more["missing_at"]] if hits else uniq
            return more

        pb = PackedBatch(lengths, T, device, tokens=True, batch_invariant=batch_invariant, extra=extra, lanes=lanes)
        new = pb.__dict__.pop("uniq", None)
        if new is None:
            new = uniq.index_select(0, pb.missing_at) if hits else uniq
        if cache is None:
            vectors = self.token_encoder(new, batch_invariant)
        else:
            vectors = cache.assemble(keys, missing, hits, new, getattr(pb, "missing_at", None),
                                     getattr(pb, "hits_at", None), self.token_encoder, batch_invariant)
        return pb, vectors.index_select(0, pb.inverse)

    def forward_tokens(self, uniq: Tensor | None, index: Tensor | None, lengths: Tensor | None,
                       state: tuple[Tensor, Tensor] | None = None, batch_invariant: bool = False,
                       layers: Sequence[int] | None = None, prepared: tuple[PackedBatch, Tensor] | None = None,
                       lanes: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The same vectors as forward(), for the real tokens only, without padding or <S> </S>, and without
        building or zero-filling a padded batch (inference, char CNN or word ids alike).

        uniq (U, ...) distinct token inputs sorted as torch.unique(dim=0) sorts them; index (B, T) int64 rows
        of uniq, -1 at padded positions (model.char_ids.distinct_char_ids); lengths (B,), boundaries included.
        Returns layers (L+1, N, 2P), N = sum(lengths - 2): row b's tokens at [offsets[b], offsets[b+1]),
        each layer contiguous; and the state as forward() returns it. batch_invariant: as forward().
        layers: only these layers, ascending, are returned, (len(layers), N, 2P): the others are still
        computed (each feeds the next) but never copied out. prepared: prepare_tokens()'s result for these inputs
        (uniq, index and lengths are then not read). lanes: as prepare_tokens (the state is then None where a
        lane holds several sentences; the same initial state, given or zeros, starts each)."""
        pb, emb = prepared if prepared is not None else self.prepare_tokens(uniq, index, lengths, batch_invariant,
                                                                            lanes)
        B = len(pb.lengths)
        fwd_rows, bwd_rows, n = pb.fwd_rows, pb.bwd_rows, pb.n_tokens
        layers = range(self.opts.n_layers + 1) if layers is None else layers
        out = emb.new_empty(len(layers), n + 2 * B, 2 * emb.shape[-1])   # every row is written
        state = self._run_layers(emb, pb, state, out, fwd_rows, bwd_rows, batch_invariant, layers)
        return out[:, :n], state

    def _run_layers(self, emb: Tensor, pb: PackedBatch, state, out: Tensor, fwd_rows: Tensor, bwd_rows: Tensor,
                    batch_invariant: bool = False, layers: Sequence[int] | None = None):
        """Layer 0 and the LSTM layers over packed token vectors emb (N, P): layer k's forward and backward
        outputs go to out[k] (rows, 2P) at fwd_rows / bwd_rows. Returns the final state in batch-row order.
        batch_invariant: the LSTMs run in a padded packed layout, step t on round_up(n_t, ROW_TILE) rows.
        layers (ascending): only these are written, layers[i] to out[i] (default: all)."""
        B, device = len(pb.lengths), emb.device
        if state is None:
            state = self.zero_state(B, device)
        h0, c0 = state
        P = emb.shape[-1]
        slot = {k: i for i, k in enumerate(range(self.opts.n_layers + 1) if layers is None else layers)}
        if 0 in slot:
            o = out[slot[0]]
            o[:, :P].index_copy_(0, fwd_rows, emb)
            o[:, P:] = o[:, :P]
        h0 = [h0[:, k][:, pb.order] for k in range(self.opts.n_layers)]     # packed row order
        c0 = [c0[:, k][:, pb.order] for k in range(self.opts.n_layers)]
        step_rows, at = None, None
        if batch_invariant and pb.batch_sizes:
            step_rows, at = pb.step_rows, pb.at       # PackedBatch(batch_invariant=True) made them
            x = emb.new_zeros(2, sum(step_rows), P)
            x[0, at], x[1, at] = emb, emb[pb.bwd_from_fwd]

            def pad(s: Tensor) -> Tensor:          # (2, lanes, D) -> (2, step_rows[0], D), zero rows appended
                n = s.shape[1]
                return torch.cat([s, s.new_zeros(2, step_rows[0] - n, s.shape[2])], dim=1) if step_rows[0] > n else s
            h0, c0 = [pad(s) for s in h0], [pad(s) for s in c0]
        else:
            x = torch.stack([emb, emb[pb.bwd_from_fwd]])                          # (2, N, P)
        h_out, c_out = [], []
        for k, (fl, bl) in enumerate(zip(self.forward_layers, self.backward_layers)):
            loop, weights = self._pair_weights(k)
            y, h, c = run_lstm_layers(loop, [fl, bl], weights, self._drop(x), pb.batch_sizes,
                                      h0[k], c0[k], step_rows, pb.resets)
            if self.opts.use_skip_connections and k > 0:
                y.add_(x)          # bilm-tf's ResidualWrapper, on every layer but the first (y is new)
            if k + 1 in slot:
                real = y if at is None else y[:, at]
                out[slot[k + 1], :, :P].index_copy_(0, fwd_rows, real[0])
                out[slot[k + 1], :, P:].index_copy_(0, bwd_rows, real[1])
            h_out.append(h)
            c_out.append(c)
            x = y
        # final states back from packed row order to batch-row order (lanes of several sentences: none)
        inv = pb.inv_order
        if inv is None:
            return None
        return torch.stack(h_out, dim=1)[:, :, inv], torch.stack(c_out, dim=1)[:, :, inv]   # (2, L, B, P|H)
