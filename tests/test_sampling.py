import numpy as np
import pytest

from strata.sampling import Sampler, SamplingParams


def _logits(seed=0, n=50):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32)


def test_greedy_is_argmax():
    z = _logits()
    assert Sampler(SamplingParams())(z) == int(np.argmax(z))


def test_seed_reproduces_and_differs():
    z = _logits()
    a = [Sampler(SamplingParams(temperature=1.0, seed=7))(z) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=7)), Sampler(SamplingParams(temperature=1.0, seed=8))
    x, y = [s1(z) for _ in range(50)], [s2(z) for _ in range(50)]
    assert a[0] == a[1] == a[2] and x != y


def test_top_k_limits_support():
    z = _logits()
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=1))
    drawn = {s(z) for _ in range(400)}
    assert drawn == set(np.argsort(-z)[:3].tolist())


def test_top_p_limits_support():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=2))
    drawn = [s(z) for _ in range(2000)]
    assert set(drawn) == {0, 1}
    assert abs(drawn.count(0) / len(drawn) - 0.5 / 0.8) < 0.05


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-2),
                                dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=-1), dict(seed=-3)])
def test_bad_values_are_clear_errors(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_non_finite_logits_raise():
    with pytest.raises(FloatingPointError):
        Sampler(SamplingParams())(np.array([0.0, np.nan]))
