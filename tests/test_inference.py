"""transforms/inference.py: ElmoModelHandler under Beam's RunInference (plain and keyed) and the Embed composite
transform, on TestPipeline with FnApiRunner (never the default runner, which would try to download Prism)."""
import numpy as np
import pytest
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that

import apache_beam as beam
from elmo_pipeline.model.embedder import ElmoEmbedder
from elmo_pipeline.tokenization import tokenize_text
from elmo_pipeline.model.resolve import ModelSpec
from elmo_pipeline.transforms.inference import ElmoModelHandler, Embed, embed_budgeted

TOL = 1e-5
SENTENCES = [["The", "cat", "sat", "."], ["A"], [], ["Long", "sentences", "come", "in", "batches", "too",
             "and", "are", "cut", "by", "the", "token", "budget", "."] * 3, ["High", "@-@", "Speed", "trains"]]


def pipeline():
    return test_pipeline.TestPipeline(runner="FnApiRunner")


@pytest.fixture(scope="module")
def tiny(tiny_model_files):
    return ModelSpec(*tiny_model_files, device="cpu", torch_threads=1), ElmoEmbedder(*tiny_model_files)


def close_to(expected: dict):
    """assert_that matcher: {key: array} equal within TOL to what came out, key by key."""
    def check(actual):
        got = dict(actual)
        assert set(got) == set(expected), (sorted(got), sorted(expected))
        for k, want in expected.items():
            assert got[k].dtype == np.float32 and got[k].shape == want.shape, k
            assert np.abs(got[k] - want).max(initial=0) <= TOL, k
    return check


def test_handler_accepts_an_empty_batch_and_budgets_sub_batches(tiny):
    spec, emb = tiny
    handler = ElmoModelHandler(spec, max_tokens_per_batch=20)
    model = handler.load_model()
    assert list(handler.run_inference([], model)) == []
    results = list(handler.run_inference(SENTENCES, model))
    assert [r.example for r in results] == SENTENCES
    for r, s in zip(results, SENTENCES):
        assert np.abs(r.inference - emb.embed_sentence(s)).max(initial=0) <= TOL
    kw = handler.batch_elements_kwargs()
    assert kw["min_batch_size"] == kw["max_batch_size"] == 20 and kw["element_size_fn"](["a", "b"]) == 4
    with pytest.raises(ValueError, match="stateless or warm"):
        ElmoModelHandler(ModelSpec(spec.options_file, spec.weight_file, state="stateful"))
    # the same input and budget: bit-identical
    again = embed_budgeted(model, SENTENCES, 20)
    assert all(np.array_equal(a.inference, b) for a, b in zip(results, again))


@pytest.mark.slow
def test_run_inference_plain_and_keyed(tiny):
    spec, emb = tiny
    handler = ElmoModelHandler(spec, max_tokens_per_batch=24)      # several batches, one over the budget
    expected = {" ".join(s): emb.embed_sentence(s) for s in SENTENCES}
    with pipeline() as p:
        sents = p | beam.Create(SENTENCES)
        plain = (sents | "Plain" >> RunInference(handler)
                 | "Key" >> beam.Map(lambda r: (" ".join(r.example), r.inference)))
        assert_that(plain, close_to(expected), label="plain")
        keyed = (sents | "AddKeys" >> beam.Map(lambda s: (" ".join(s), s))
                 | "Keyed" >> RunInference(KeyedModelHandler(handler))
                 | "Arrays" >> beam.MapTuple(lambda k, r: (k, r.inference)))
        assert_that(keyed, close_to(expected), label="keyed")


@pytest.mark.slow
def test_embed_texts_token_lists_and_keyed_texts(tiny):
    spec, emb = tiny
    texts = ["The High-Speed train left. It was late!", "One more sentence here.", " \x01 "]
    handler = ElmoModelHandler(spec, max_tokens_per_batch=32)
    want_texts = {(t, i): emb.embed_sentence(s) for t in texts for i, s in enumerate(tokenize_text(t))}
    assert ("The High-Speed train left. It was late!", 1) in want_texts and len(want_texts) == 3
    with pipeline() as p:
        out = (p | "Texts" >> beam.Create(texts) | "EmbedTexts" >> Embed(handler)
               | "K1" >> beam.Map(lambda e: ((e.key, e.sentence), e.vectors)))
        assert_that(out, close_to(want_texts), label="texts")
        toks = (p | "Tokens" >> beam.Create(SENTENCES) | "EmbedTokens" >> Embed(handler)
                | "K2" >> beam.Map(lambda e: (e.key, e.vectors)))
        assert_that(toks, close_to({tuple(s): emb.embed_sentence(s) for s in SENTENCES}), label="tokens")
        keyed = (p | "Keyed" >> beam.Create([(7, texts[0]), ("b", ["x", "y"])])
                 | "EmbedKeyed" >> Embed(handler, keyed=True)
                 | "K3" >> beam.Map(lambda e: ((e.key, e.sentence, e.tokens), e.vectors)))
        s0, s1 = tokenize_text(texts[0])
        assert_that(keyed, close_to({(7, 0, tuple(s0)): emb.embed_sentence(s0), (7, 1, tuple(s1)): emb.embed_sentence(s1),
                                     ("b", 0, ("x", "y")): emb.embed_sentence(["x", "y"])}), label="keyed")


@pytest.mark.slow
def test_embed_by_name_follows_the_model_tokenization():
    """The shipped model by name: raw text is split WikiText-style (its training text's scheme)."""
    emb = ElmoEmbedder.from_name("wikitext2-small")
    text = "The High-Speed train."
    with pipeline() as p:
        out = (p | beam.Create([text]) | Embed("wikitext2-small", torch_threads=1)
               | beam.Map(lambda e: (e.tokens, e.vectors)))
        tokens = ("The", "High", "@-@", "Speed", "train", ".")
        assert_that(out, close_to({tokens: emb.embed_sentence(list(tokens))}))


LOADS = []


class CountingHandler(ElmoModelHandler):
    def load_model(self):
        LOADS.append(1)
        return super().load_model()


@pytest.mark.slow
def test_one_model_per_process_through_beams_shared_handle(tiny):
    """Many bundles and batches (a Reshuffle before RunInference), one load: RunInference's shared handle."""
    spec, emb = tiny
    LOADS.clear()
    sentences = [[f"w{i}", "and", f"v{i % 7}"] * (1 + i % 4) for i in range(200)]
    with pipeline() as p:
        out = (p | beam.Create(sentences) | beam.Reshuffle()
               | RunInference(CountingHandler(spec, max_tokens_per_batch=32))
               | beam.Map(lambda r: (" ".join(r.example), r.inference)))
        assert_that(out, close_to({" ".join(s): emb.embed_sentence(s) for s in sentences}))
    assert len(LOADS) == 1
