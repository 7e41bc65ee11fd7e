import pytest
import torch

from elmo_pipeline.model import ScalarMix


def test_uniform_mix_is_mean():
    x = torch.randn(3, 2, 5, 4)
    mix = ScalarMix(3, trainable=False)
    torch.testing.assert_close(mix(x), x.mean(0))
    assert not any(p.requires_grad for p in mix.parameters())


def test_weights_and_gamma():
    x = torch.randn(3, 2, 5, 4)
    mix = ScalarMix(3, initial_weights=[0.0, 0.0, 100.0], gamma=2.0)
    torch.testing.assert_close(mix(x), 2.0 * x[2])
    mix(x).sum().backward()
    assert mix.weights.grad is not None and mix.gamma.grad is not None


def test_layer_norm_is_per_sentence():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 6, 4)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    x[:, 1, 3:] = 1000.0                     # padding garbage must not matter
    mix = ScalarMix(3, layer_norm=True)
    both = mix(x, mask)
    alone = mix(x[:, 1:, :3], mask[1:, :3])
    torch.testing.assert_close(both[1:, :3], alone)
    # another sentence in the batch does not change this one
    x2 = x.clone()
    x2[:, 0] *= 50
    torch.testing.assert_close(mix(x2, mask)[1], both[1])
    # each layer normalized: zero mean, unit variance over valid values
    n = ScalarMix._normalize(x, mask)
    torch.testing.assert_close(n[:, 1, :3].mean(dim=(-2, -1)), torch.zeros(3), atol=1e-5, rtol=0)


def test_wrong_layer_count():
    with pytest.raises(ValueError):
        ScalarMix(3)(torch.randn(2, 4, 4))
