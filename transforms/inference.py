"""ELMo in any Beam pipeline: a ModelHandler for RunInference, and the composite transform Embed.

    import apache_beam as beam
    from elmo_pipeline.transforms.inference import Embed
    with beam.Pipeline() as p:
        (p | beam.Create(["First text. Two sentences.", "Another one."])
           | Embed("wikitext2-small")                   # Embedded(key, sentence, tokens, vectors (L+1, T, 2P))
           | beam.Map(print))

ElmoModelHandler: token list in, PredictionResult(example=tokens, inference=float32 (L+1, T, 2P)) out: the
arrays ElmoEmbedder.embed_sentence gives. Batches are cut by a token budget (BatchElements with
element_size_fn = T + 2, min = max = the budget: deterministic given the bundle's order); inside a batch the
sentences run in length-sorted sub-batches of at most the budget in token slots (model.batching.plan_batches).
RunInference loads the model once per process (its shared handle); KeyedModelHandler(handler) takes
(key, tokens). Stateless and warm state modes only (stateful needs consecutive sentences in input order).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.ml.inference.base import KeyedModelHandler, ModelHandler, PredictionResult, RunInference

from elmo_pipeline.model.resolve import ModelSpec
from elmo_pipeline.transforms.embed import load_embedder


class ElmoModelHandler(ModelHandler):
    """RunInference handler: a token list -> float32 (L+1, T, 2P). spec: what to load (model.resolve.ModelSpec);
    max_tokens_per_batch: the token budget of a batch (<S> </S> and padding included); bucket_boundaries:
    optionally batch sentences of similar length together (Beam's length buckets, by token count;
    max_batch_duration_secs bounds how long a bucket waits)."""

    def __init__(self, spec: ModelSpec, max_tokens_per_batch: int = 4096, tokenization: str | None = None,
                 bucket_boundaries: list[int] | None = None, max_batch_duration_secs: int | None = None):
        if spec.state == "stateful":
            raise ValueError("RunInference batches are not consecutive sentences: use state stateless or warm")
        if max_tokens_per_batch < 3:
            raise ValueError(f"max_tokens_per_batch must be >= 3, got {max_tokens_per_batch}")
        bucketed = {"batch_length_fn": len, "batch_bucket_boundaries": bucket_boundaries,
                    "max_batch_duration_secs": max_batch_duration_secs or 1} if bucket_boundaries else {}
        # max_batch_weight= raises TypeError in Beam 2.77: the weight budget is min = max batch "size" with an
        # element_size_fn (which may emit an empty batch before an element over the budget: run_inference takes it)
        super().__init__(min_batch_size=max_tokens_per_batch, max_batch_size=max_tokens_per_batch,
                         element_size_fn=_slots, **bucketed)
        self.spec, self.max_tokens = spec, max_tokens_per_batch
        self.tokenization = tokenization     # the model's training-text tokenization (Embed's raw tokenizer)

    @classmethod
    def from_name(cls, name: str, *, device: str = "auto", state: str = "stateless", torch_threads: int = 0,
                  compute_dtype: str = "float32", **kwargs) -> "ElmoModelHandler":
        """A handler for a model by name (model.pretrained: downloaded and verified here, at construction)."""
        import dataclasses

        from elmo_pipeline.model.resolve import resolve_model
        spec = dataclasses.replace(resolve_model(name), device=device, state=state, torch_threads=torch_threads,
                                   compute_dtype=compute_dtype)
        return cls(spec, tokenization=spec.tokenization, **kwargs)

    def load_model(self):
        return load_embedder(self.spec)

    def run_inference(self, batch: Sequence[Sequence[str]], model, inference_args: dict | None = None
                      ) -> Iterable[PredictionResult]:
        """One PredictionResult per sentence, in batch order; an empty batch gives none."""
        return [PredictionResult(tokens, vectors) for tokens, vectors in zip(batch, embed_budgeted(model, batch, self.max_tokens))]

    def get_num_bytes(self, batch: Sequence[Sequence[str]]) -> int:
        return sum(len(t.encode("utf-8")) + 1 for s in batch for t in s)

    def get_metrics_namespace(self) -> str:
        return "elmo"

    def share_model_across_processes(self) -> bool:
        return False


def _slots(tokens: Sequence[str]) -> int:
    """A sentence's weight in the batch budget: its tokens plus <S> and </S>."""
    return len(tokens) + 2


def embed_budgeted(embedder, sentences: Sequence[Sequence[str]], max_tokens: int) -> list[np.ndarray]:
    """(L+1, T_i, 2P) float32 per sentence, in order, run in length-sorted sub-batches of at most `max_tokens`
    padded slots, or token slots where the embedder lays sentences in lanes (a sentence over the budget runs
    alone): model.batching."""
    from elmo_pipeline.model.batching import embed_in_batches, plan_batches
    sentences = [list(s) for s in sentences]
    batches = plan_batches([len(s) for s in sentences], max_tokens, lanes=getattr(embedder, "lanes", False))
    return embed_in_batches(embedder.embed_batch, sentences, batches)


class Embedded(NamedTuple):
    """One embedded sentence: key (the input's key, or the input itself when unkeyed: a text, or a token tuple),
    sentence (its index in the text; 0 for a token list), tokens, vectors float32 (L+1, T, 2P)."""
    key: Any
    sentence: int
    tokens: tuple[str, ...]
    vectors: np.ndarray


def sentences_of(element, keyed: bool, tokenizer: str) -> list[tuple[tuple[Any, int], list[str]]]:
    """((key, sentence index), tokens) for each sentence of one input element: a text (tokenized with the project
    tokenizer: tokenization.tokenize_text) or a token list; keyed: the element is (key, text or tokens)."""
    key, value = element if keyed else (element if isinstance(element, str) else tuple(element), element)
    if isinstance(value, str):
        from elmo_pipeline.tokenization import tokenize_text
        return [((key, i), s) for i, s in enumerate(tokenize_text(value, tokenizer))]
    return [((key, 0), list(value))]


class Embed(beam.PTransform):
    """PCollection of texts or token lists (or (key, text or tokens) with keyed=True) -> PCollection of Embedded,
    one per sentence. model: a name (model.pretrained) or an ElmoModelHandler. tokenizer: for texts; raw follows
    the model's training-text tokenization (tokenization.resolve_tokenizer). A text without tokens gives nothing."""

    def __init__(self, model: str | ElmoModelHandler = "wikitext2-small", keyed: bool = False,
                 tokenizer: str = "raw", max_tokens_per_batch: int = 4096, **handler_args):
        super().__init__()
        from elmo_pipeline.tokenization import resolve_tokenizer
        self.handler = (model if isinstance(model, ElmoModelHandler) else
                        ElmoModelHandler.from_name(model, max_tokens_per_batch=max_tokens_per_batch, **handler_args))
        self.keyed, self.tokenizer = keyed, resolve_tokenizer(tokenizer, self.handler.tokenization)

    def expand(self, pcoll):
        return (pcoll
                | "Sentences" >> beam.FlatMap(sentences_of, self.keyed, self.tokenizer)
                | "RunInference" >> RunInference(KeyedModelHandler(self.handler))
                | "Unpack" >> beam.MapTuple(lambda k, r: Embedded(k[0], k[1], tuple(r.example), r.inference)))
