import pytest
import torch

from skippy.mesh.sampler import Sampler, SamplingParams


def test_temperature_zero_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def test_seeded_sampling_repeats_and_seeds_differ():
    logits = torch.randn(1000)
    a = Sampler(SamplingParams(1.0, seed=5))
    b = Sampler(SamplingParams(1.0, seed=5))
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]
    c = Sampler(SamplingParams(1.0, seed=6))
    assert [a(logits) for _ in range(20)] != [c(logits) for _ in range(20)]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(500)
    best = int(logits.argmax())
    assert all(Sampler(SamplingParams(2.0, top_k=1, seed=s))(logits) == best for s in range(10))
    assert all(Sampler(SamplingParams(2.0, top_p=1e-6, seed=s))(logits) == best for s in range(10))


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(500)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(SamplingParams(5.0, top_k=5, seed=1))
    assert all(s(logits) in allowed for _ in range(200))


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5},
                                {"top_k": -1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
