import pytest
import torch

from skippy.mesh.sampler import Sampler, SamplingParams
from skippy.topology.errors import RequestError


@pytest.fixture(autouse=True)
def _seeded():
    # xdist workers start at different torch seeds: every random row is the same in each run
    torch.manual_seed(0)


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
                                {"top_k": -1}, {"top_k": 2**40}, {"presence_penalty": 2.5},
                                {"frequency_penalty": -3.0}, {"logit_bias": ((1, 101.0),)}])
def test_bad_settings_are_the_requests_fault_naming_the_field(kw):
    with pytest.raises(RequestError) as refused:
        SamplingParams(**kw)
    assert refused.value.param == next(iter(kw))


def test_logit_bias_moves_the_greedy_choice_and_ignores_ids_past_the_vocabulary():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(logit_bias=((3, 4.5),)))(logits) == 3
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),)))(logits) == 2
    assert Sampler(SamplingParams(logit_bias=((9, 100.0),)))(logits) == 1
    assert logits.tolist() == pytest.approx([0.1, 3.0, 2.9, -1.0])  # the row is untouched


def test_presence_penalty_counts_a_token_once_and_frequency_per_use():
    logits = torch.tensor([5.0, 4.0, 0.0])
    once = Sampler(SamplingParams(presence_penalty=1.5))
    assert [once(logits) for _ in range(3)] == [0, 1, 0]   # 5-1.5 < 4, then 4-1.5 < 3.5
    often = Sampler(SamplingParams(frequency_penalty=0.6))
    # 0 is penalized 0.6 per use: it wins until its logit falls below 1's
    assert [often(logits) for _ in range(4)] == [0, 0, 1, 0]
    assert often.counts == {0: 3, 1: 1}


def test_penalties_apply_to_seeded_sampling_repeatably():
    # one clear favourite: without the penalty it is drawn most times, with it a few times
    logits = torch.randn(300)
    logits[0] = 8.0
    params = SamplingParams(1.0, seed=9, frequency_penalty=2.0, logit_bias=((7, 3.0),))
    a, b = Sampler(params), Sampler(params)
    assert [a(logits) for _ in range(30)] == [b(logits) for _ in range(30)]
    plain, adjusted = Sampler(SamplingParams(1.0, seed=9)), Sampler(params)
    assert [plain(logits) for _ in range(30)] != [adjusted(logits) for _ in range(30)]


def test_a_rebuilt_request_counts_the_tokens_it_already_generated():
    logits = torch.tensor([5.0, 4.0, 0.0])
    params = SamplingParams(frequency_penalty=0.6)
    whole = Sampler(params)
    tokens = [whole(logits) for _ in range(4)]
    resumed = Sampler(params, generated=tokens[:2])
    assert [resumed(logits) for _ in range(2)] == tokens[2:]
    assert Sampler(params)(logits) != tokens[2]  # without the history it would differ


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=5),
                                    SamplingParams(temperature=1.2, top_p=0.9, top_k=50,
                                                   seed=7, presence_penalty=0.5)])
def test_a_rebuilt_seeded_request_goes_on_with_the_tokens_it_would_have_drawn(params):
    # After a stage fault the last stage's new sampler gets the tokens so far; it must
    # continue the same random sequence, not start it again from the seed.
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(4096, generator=gen) * 3 for _ in range(12)]
    whole = Sampler(params)
    tokens = [whole(x) for x in logits]
    rebuilt = Sampler(params, generated=tokens[:5])
    assert [rebuilt(x) for x in logits[5:]] == tokens[5:]
    restarted = Sampler(params)
    assert [restarted(x) for x in logits[5:]] != tokens[5:]  # what a restart would give


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324])
def test_a_temperature_that_overflows_the_scaled_logits_is_greedy(temperature):
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature, seed=3))(logits) == 1
    assert Sampler(SamplingParams(temperature, top_p=0.5, top_k=2))(logits) == 1
    biased = SamplingParams(temperature, logit_bias=((3, 4.5),), seed=1)
    assert Sampler(biased)(logits) == 3  # the argmax of the adjusted logits


def test_an_overflowing_step_takes_one_draw_so_a_rebuilt_request_still_follows():
    # Rows near 1e-37 scale to ordinary scores at this temperature; a row near 100
    # overflows float32 and falls back to greedy. A rebuilt sampler skips one draw per
    # token generated, so the fallback must have taken one too.
    params = SamplingParams(1e-37, seed=21)
    gen = torch.Generator().manual_seed(4)
    logits = [torch.randn(2048, generator=gen) * (100 if i == 4 else 1e-37)
              for i in range(10)]
    whole = Sampler(params)
    tokens = [whole(x) for x in logits]
    assert tokens[4] == int(logits[4].argmax())
    for k in (3, 4, 5, 7):
        rebuilt = Sampler(params, generated=tokens[:k])
        assert [rebuilt(x) for x in logits[k:]] == tokens[k:], k
    restarted = Sampler(params)
    assert [restarted(x) for x in logits[5:]] != tokens[5:]


@pytest.mark.parametrize("kw", [{"temperature": float("nan")}, {"temperature": float("inf")},
                                {"top_p": float("nan")}, {"presence_penalty": float("inf")},
                                {"frequency_penalty": float("nan")},
                                {"logit_bias": ((1, float("nan")),)}])
def test_non_finite_settings_are_refused(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw)
