"""Stateless and warm modes: a sentence's vectors do not depend on its batch or its position."""
import numpy as np
import pytest

from elmo_pipeline.model import ElmoEmbedder

TOL = 1e-6


def _sentences(n=64, seed=0):
    rng = np.random.default_rng(seed)
    words = "the a cat dog sat on mat ran quickly over lazy fox , . and but in 1998 Zürich 東京 ☃".split()
    return [list(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(n)]


@pytest.mark.parametrize("state", ["stateless", "warm"])
def test_sentence_independent_of_batch(tiny_model_files, state):
    e = ElmoEmbedder(*tiny_model_files, state=state)
    sents = _sentences()
    alone = [e.embed_sentence(s) for s in sents]
    batch = e.embed_batch(sents)
    rev = e.embed_batch(sents[::-1])[::-1]
    streamed = list(e.embed_sentences(sents, batch_size=7))
    budget = list(e.embed_sentences(sents, max_tokens=50))      # token-budget batches, several windows
    for a, b, r, s, t in zip(alone, batch, rev, streamed, budget):
        assert a.shape == (3, a.shape[1], 16)
        for other in (b, r, s, t):
            assert np.abs(a - other).max() <= TOL
    # a second run is identical (nothing carried over)
    assert all(np.array_equal(x, y) for x, y in zip(batch, e.embed_batch(sents)))


def test_warm_differs_from_stateless(tiny_model_files):
    s = _sentences(1)[0]
    a = ElmoEmbedder(*tiny_model_files, state="stateless").embed_sentence(s)
    b = ElmoEmbedder(*tiny_model_files, state="warm").embed_sentence(s)
    np.testing.assert_allclose(a[0], b[0], atol=TOL, rtol=0)   # token layer has no state
    assert np.abs(a[1:] - b[1:]).max() > 1e-4


def test_stateful_carries_state_per_row(tiny_model_files):
    sents = _sentences(6)
    e = ElmoEmbedder(*tiny_model_files, state="stateful", batch_size=3)
    first = e.embed_batch(sents[:3])
    second = e.embed_batch(sents[3:])
    fresh = ElmoEmbedder(*tiny_model_files, state="stateless").embed_batch(sents)
    np.testing.assert_allclose(first[0], fresh[0], atol=TOL)        # first batch starts from zeros
    assert np.abs(second[0][1:] - fresh[3][1:]).max() > 1e-4        # second batch does not
    e.reset_states()
    np.testing.assert_allclose(e.embed_batch(sents[3:])[0], fresh[3], atol=TOL)


def test_empty_sentences(tiny_model_files):
    for state in ("stateless", "warm", "stateful"):
        e = ElmoEmbedder(*tiny_model_files, state=state)
        assert e.embed_sentence([]).shape == (3, 0, 16)
        out = e.embed_batch([[], ["a", "b"], []])
        assert [o.shape for o in out] == [(3, 0, 16), (3, 2, 16), (3, 0, 16)]
        assert e.embed_batch([]) == []


def test_layer0_is_token_vector_duplicated(tiny_model_files):
    v = ElmoEmbedder(*tiny_model_files).embed_sentence(["hello", "world"])
    np.testing.assert_array_equal(v[0, :, :8], v[0, :, 8:])


def test_bad_arguments(tiny_model_files):
    with pytest.raises(ValueError, match="state"):
        ElmoEmbedder(*tiny_model_files, state="sometimes")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        ElmoEmbedder(*tiny_model_files, device="cuda")


def test_token_cache_reuses_vectors_and_follows_weight_changes(tiny_model_files):
    import torch
    sents = _sentences(40, seed=3)
    plain = ElmoEmbedder(*tiny_model_files, token_cache=0)
    cached = ElmoEmbedder(*tiny_model_files)
    expect = plain.embed_batch(sents)
    for _ in range(2):                     # second pass: every token comes from the cache
        for a, b in zip(expect, cached.embed_batch(sents)):
            assert np.abs(a - b).max() <= TOL
    assert len(cached.model.token_cache.vectors) > 0
    with torch.no_grad():                  # new weights in place: cached vectors must not be reused
        cached.model.token_encoder.char_embed.weight.mul_(2.0)
        plain.model.token_encoder.char_embed.weight.mul_(2.0)
    for a, b in zip(plain.embed_batch(sents), cached.embed_batch(sents)):
        assert np.abs(a - b).max() <= TOL


def test_token_budget_refused_in_stateful_mode(tiny_model_files):
    e = ElmoEmbedder(*tiny_model_files, state="stateful")
    with pytest.raises(ValueError, match="stateful"):
        list(e.embed_sentences([["a"]], max_tokens=100))
