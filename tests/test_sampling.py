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


def test_min_p_limits_support():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.35, seed=4))          # keeps p >= 0.175
    drawn = [s(z) for _ in range(2000)]
    assert set(drawn) == {0, 1}
    assert abs(drawn.count(0) / len(drawn) - 0.5 / 0.8) < 0.05


@pytest.mark.parametrize("t", [1e-310, 5e-324, 1e-6, 9.99e-6])
def test_tiny_temperatures_are_greedy(t):
    z = _logits(3)
    assert Sampler(SamplingParams(temperature=t, seed=0))(z) == int(np.argmax(z))


@pytest.mark.parametrize("t", [1e-5, 1e-3, 1e300])
def test_extreme_temperatures_give_probabilities(t):
    """Just above the greedy threshold and absurdly hot: finite probabilities that sum to one."""
    z = np.array([3e38, 3.4e38, -3e38, 0.0], np.float32)
    s = Sampler(SamplingParams(temperature=t, top_p=0.9, min_p=0.01, seed=0))
    seen = []
    pick = s._pick
    s._pick = lambda p: (seen.append(p.copy()), pick(p))[1]
    tok = s(z)
    p = seen[-1]
    assert np.all(np.isfinite(p)) and abs(p.sum() - 1) < 1e-12
    assert tok == 1 if t < 1 else np.allclose(p, 0.25)              # hot: uniform


def test_repetition_penalty_matches_transformers():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(5)
    prompt = [3, 7, 7, 11]
    for penalty in (0.7, 1.3, 2.0):
        s = Sampler(SamplingParams(repetition_penalty=penalty), prompt)
        seq = list(prompt)
        for _ in range(30):
            z = rng.normal(scale=2.0, size=16).astype(np.float32)
            z[seq[-1]] = 4.0                                    # a repeat is likely without the penalty
            want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seq]), torch.tensor(z[None]).double())
            tok = s(z)
            assert tok == int(want.argmax())
            seq.append(tok)


def test_presence_and_frequency_penalties():
    """OpenAI's formula, worked by hand: logit - count * frequency - (count > 0) * presence, over generated tokens."""
    z = np.array([1.0, 0.5, 0.0])
    s = Sampler(SamplingParams(frequency_penalty=0.3), prompt=[0, 0, 0])     # the prompt does not count
    assert [s(z) for _ in range(7)] == [0, 0, 1, 0, 1, 0, 2]
    s = Sampler(SamplingParams(presence_penalty=0.6))
    assert [s(z) for _ in range(4)] == [0, 1, 0, 0]
    s = Sampler(SamplingParams(presence_penalty=-2.0))                       # negative: repeat on purpose
    assert [s(np.array([1.0, 1.5])) for _ in range(3)] == [1, 1, 1]


def test_logprobs_are_the_models_log_softmax():
    import torch
    z = _logits(9, n=64)
    want = torch.log_softmax(torch.tensor(z).double(), -1).numpy()
    s = Sampler(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=4, seed=1), prompt=[1])
    tok = s(z)
    assert abs(s.logprobs.logprob - want[tok]) < 1e-12
    order = np.argsort(-want, kind="stable")[:4]
    assert [i for i, _ in s.logprobs.top] == order.tolist()
    assert np.allclose([v for _, v in s.logprobs.top], want[order], rtol=0, atol=1e-12)
    assert Sampler(SamplingParams())(z) == int(np.argmax(z)) and Sampler(SamplingParams()).logprobs is None


def test_logprobs_ties_and_sizes():
    z = np.array([1.0, 3.0, 3.0, 0.0, 3.0])
    s = Sampler(SamplingParams(logprobs=2))
    assert s(z) == 1 and [i for i, _ in s.logprobs.top] == [1, 2]            # ties: the lower id first
    s = Sampler(SamplingParams(logprobs=0))
    s(z)
    assert s.logprobs.top == ()
    s = Sampler(SamplingParams(logprobs=20))
    s(z)
    assert [i for i, _ in s.logprobs.top] == [1, 2, 4, 0, 3]


@pytest.mark.parametrize("kw", [dict(min_p=-0.1), dict(min_p=1.5), dict(presence_penalty=2.5),
                                dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                                dict(repetition_penalty=1000.0), dict(logprobs=21), dict(logprobs=-1),
                                dict(stop=[""]), dict(stop=[1]), dict(stop_token_ids=[-1]), dict(temperature=True),
                                dict(top_k=2.0), dict(max_tokens=True), dict(temperature="0.5"),
                                dict(temperature=float("inf"))])
def test_more_bad_values_name_their_parameter(kw):
    from strata.sampling import SamplingError
    with pytest.raises(SamplingError, match=next(iter(kw))) as e:
        SamplingParams(**kw)
    assert e.value.param == next(iter(kw))


def test_stop_and_stop_ids_are_normalized():
    p = SamplingParams(stop="END", stop_token_ids=[np.int64(5), 7])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 7) and type(p.stop_token_ids[0]) is int


def test_top_p_set_is_the_full_sorts():
    """The top_p set built from the tokens within TOP_P_FLOOR of the top, else the most probable 1024 tokens first
    (strata.sampling._top_p_prefix), equals the definition over the whole stably sorted vocabulary, ties and flat
    distributions included; each of the three ways ran."""
    from strata.sampling import TOP_P_FIRST, TOP_P_FLOOR, TOP_P_FLOOR_MAX, _top_p_prefix
    rng = np.random.default_rng(5)
    flat = floor = 0
    for trial in range(200):
        n = int(rng.integers(2, 6 * TOP_P_FIRST))
        z = rng.standard_normal(n) * rng.choice([0.05, 1.0, 5.0, 30.0])
        if trial % 3 == 0:
            z = np.round(z, 1)                                  # ties at the cut
        p = np.exp(z - z.max())
        p /= p.sum()
        top_p = float(rng.uniform(0.05, 0.999))
        order = np.argsort(-p, kind="stable")
        want = np.sort(order[np.cumsum(p[order]) - p[order] < top_p])
        assert np.array_equal(_top_p_prefix(p, top_p), want), (trial, n, top_p)
        flat += len(want) > TOP_P_FIRST
        near = p >= p.max() * TOP_P_FLOOR
        floor += n > TOP_P_FIRST and near.sum() <= TOP_P_FLOOR_MAX and p[near].sum() >= top_p * (1 + 1e-9)
    assert flat > 10 and floor > 10                             # the flat distributions' and the floor's paths
    n = 248_320                  # past the floor's count but the top 1024's mass reaching top_p: the partition's
    p = np.full(n, 2.5e-6)
    p[rng.choice(n, TOP_P_FIRST, replace=False)] = rng.uniform(4e-4, 6e-4, TOP_P_FIRST)
    p /= p.sum()
    near = p >= p.max() * TOP_P_FLOOR
    assert near.sum() > TOP_P_FLOOR_MAX and np.sort(p)[-TOP_P_FIRST:].sum() > 0.3
    order = np.argsort(-p, kind="stable")
    want = np.sort(order[np.cumsum(p[order]) - p[order] < 0.3])
    assert np.array_equal(_top_p_prefix(p, 0.3), want)
    z = rng.standard_normal(248_320) / 0.7                      # the flash vocabulary, flat: most of it is kept
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    for top_p in (0.5, 0.9, 0.999):
        want = np.sort(order[np.cumsum(p[order]) - p[order] < top_p])
        assert np.array_equal(_top_p_prefix(p, top_p), want), top_p


def test_draws_follow_the_probabilities():
    """Over a vocabulary of 248,320 (the buffers' path) with top_k, top_p and min_p: every draw is in the filtered
    set, and the draws' frequencies of its likelier tokens match their renormalized probabilities (chi-square,
    4 sigma)."""
    n = 248_320
    rng = np.random.default_rng(9)
    z = (rng.standard_normal(n) - 6).astype(np.float32)        # peaked, as a trained model's: the top_p set small
    z[:6] = [9.0, 8.5, 8.0, 7.6, 7.0, 6.0]
    for kw in (dict(temperature=0.8, top_p=0.9), dict(temperature=0.8, top_k=4), dict(temperature=1.0, min_p=0.05),
               dict(temperature=0.5)):
        s = Sampler(SamplingParams(seed=3, **kw))
        x = (z.astype(np.float64) - z.max()) / kw["temperature"]
        p = np.exp(x) / np.exp(x).sum()
        if "top_k" in kw:
            p = np.where(np.arange(n) < kw["top_k"], p, 0)
        if "top_p" in kw:
            order = np.argsort(-p, kind="stable")
            keep = np.zeros(n, bool)
            keep[order[np.cumsum(p[order]) - p[order] < kw["top_p"]]] = True
            p = np.where(keep, p, 0)
        p /= p.sum()
        if "min_p" in kw:
            p = np.where(p >= kw["min_p"] * p.max(), p, 0)
            p /= p.sum()
        draws = np.array([s(z) for _ in range(1500)])
        top = np.flatnonzero(p > 1e-2)
        assert set(draws.tolist()) <= set(np.flatnonzero(p > 0).tolist()), kw
        counts = np.array([(draws == i).sum() for i in top])
        expect = p[top] * len(draws)
        chi2 = float(((counts - expect) ** 2 / expect).sum())
        assert chi2 < len(top) + 4 * np.sqrt(2 * len(top)), (kw, chi2)


def test_pick_in_two_levels_is_the_inverse_cdf():
    """Over a long vector _pick sums blocks first, then one block: the index is the full cumulative sum's for the
    same uniform draw, never a token of probability 0 (zero blocks, a zero tail, a draw at the very top)."""
    from types import SimpleNamespace

    from strata.sampling import PICK_BLOCK
    rng = np.random.default_rng(5)
    n = 20 * PICK_BLOCK + 77
    p = rng.random(n) ** 4
    p[3 * PICK_BLOCK - 5:5 * PICK_BLOCK + 9] = 0.0
    p[-PICK_BLOCK - 100:] = 0.0
    p /= p.sum()
    us = np.concatenate([rng.random(3000), [0.0, 1.0 - 2.0 ** -53]])
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    draws = iter(us)
    s.rng = SimpleNamespace(random=lambda: next(draws))
    cdf = np.cumsum(p)
    for u in us:
        got = s._pick(p.copy())
        want = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)
        want = want if p[want] > 0 else int(np.flatnonzero(p)[-1])
        assert got == want and p[got] > 0, (u, got, want)


def test_penalties_equal_the_whole_vocabulary_formula():
    """_penalize touches only the prompt's and the output's tokens: the logits it gives equal, bit for bit, the
    formula over the whole vocabulary (repetition on every seen token, then frequency and presence on every
    generated one), step after step."""
    rng = np.random.default_rng(11)
    n = 5000
    for kw in (dict(repetition_penalty=1.3), dict(frequency_penalty=0.4, presence_penalty=-0.7),
               dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=0.5)):
        prompt = rng.integers(0, n, 60)
        s = Sampler(SamplingParams(temperature=1.0, seed=5, **kw), prompt=prompt)
        counts, seen = np.zeros(n, np.int64), np.zeros(n, bool)
        seen[prompt] = True
        for _ in range(40):
            z = (rng.standard_normal(n) * 3).astype(np.float32)
            want = z.astype(np.float64)
            if s.p.repetition_penalty != 1:
                rp = s.p.repetition_penalty
                want = np.where(seen, np.where(want > 0, want / rp, want * rp), want)
            want = want - s.p.frequency_penalty * counts - s.p.presence_penalty * (counts > 0)
            assert np.array_equal(s._penalize(z.astype(np.float64)), want), kw
            tok = s(z)
            counts[tok] += 1
            seen[tok] = True


def test_logprobs_equal_the_whole_log_softmax():
    """token_logprobs forms only the values it returns: equal, bit for bit, to the log-softmax of the whole row
    (float64, maximum subtracted) and its k largest by (-logprob, id), ties included."""
    from strata.sampling import token_logprobs
    rng = np.random.default_rng(12)
    for trial in range(30):
        z = (rng.standard_normal(3000) * rng.choice([0.1, 2.0, 20.0])).astype(np.float32)
        if trial % 2:
            z = np.round(z, 1)
        zz = z.astype(np.float64)
        zz -= zz.max()
        lp = zz - np.log(np.exp(zz).sum())
        tok = int(rng.integers(0, z.size))
        for k in (0, 1, 5, 20):
            order = np.lexsort((np.arange(z.size), -lp))[:k]
            got = token_logprobs(z, tok, k)
            assert got.logprob == lp[tok]
            assert [i for i, _ in got.top] == order.tolist() and [v for _, v in got.top] == lp[order].tolist()
