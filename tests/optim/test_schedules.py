"""Tests of rudax.optim's schedules against plain numpy formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rudax.optim as ro
from tests.optim._bad_input import rejects


def step_reference(n: int, init_value: float, step_size: int, gamma: float) -> float:
    return init_value * gamma ** (n // step_size)


def warmup_cosine_reference(n, peak, warmup, decay, init, end) -> float:
    if n < warmup:
        return init + (peak - init) * n / warmup
    t = min(n - warmup, decay - warmup) / (decay - warmup)
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * t))


def evaluate(schedule, counts, mode: str) -> np.ndarray:
    """The schedule at each count: Python ints, int32 arrays, or a traced count under jit."""
    if mode == "python_int":
        values = [schedule(int(n)) for n in counts]
    elif mode == "int32":
        values = [schedule(jnp.int32(n)) for n in counts]
    elif mode == "jit":
        fn = jax.jit(schedule)
        values = []
        for n in counts:
            values.append(fn(jnp.int32(n)))
            assert fn._cache_size() == 1, "the schedule recompiled for a new count"
    else:
        raise ValueError(mode)
    for v in values:
        assert v.dtype == jnp.float32 and v.shape == (), (v.dtype, v.shape)
    return np.asarray([np.asarray(v) for v in values])


MODES = ["python_int", "int32", "jit"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "init_value, step_size, gamma",
    [(1e-3, 100, 0.5), (0.3, 7, 0.9), (2.0, 1, 1.5), (-0.1, 3, 0.1)],
)
def test_step_schedule_matches_reference(mode, init_value, step_size, gamma):
    counts = sorted(
        {0, 1, step_size - 1, step_size, step_size + 1, 3 * step_size, 5 * step_size + 2}
    )
    got = evaluate(ro.step_schedule(init_value, step_size, gamma), counts, mode)
    want = [step_reference(n, init_value, step_size, gamma) for n in counts]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_step_schedule_halves_every_100_updates():
    schedule = ro.step_schedule(1e-3, step_size=100, gamma=0.5)
    got = evaluate(schedule, [0, 99, 100, 199, 200, 299, 300], "jit")
    np.testing.assert_array_equal(
        got, np.float32([1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4, 1.25e-4])
    )


WARMUP_COSINE_CASES = [
    # peak, warmup, decay, init, end
    (1.0, 10, 110, 0.0, 0.0),
    (3e-4, 5, 23, 1e-5, 2e-5),
    (0.5, 0, 17, 0.0, 0.1),  # no warmup: starts at the peak
    (0.0, 4, 12, 0.2, 0.3),  # zero peak: optax would ignore end_value here
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("peak, warmup, decay, init, end", WARMUP_COSINE_CASES)
def test_warmup_cosine_matches_reference(mode, peak, warmup, decay, init, end):
    schedule = ro.warmup_cosine_schedule(peak, warmup, decay, init_value=init, end_value=end)
    counts = [*range(decay + 3), decay + 100, 10**6]
    got = evaluate(schedule, counts, mode)
    want = [warmup_cosine_reference(n, peak, warmup, decay, init, end) for n in counts]
    # fp32 cos near pi has an absolute error of a few 1e-8; scale that by the value range.
    scale = max(abs(peak), abs(init), abs(end))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.parametrize("peak, warmup, decay, init, end", WARMUP_COSINE_CASES)
def test_warmup_cosine_hits_peak_and_end_exactly(peak, warmup, decay, init, end):
    schedule = ro.warmup_cosine_schedule(peak, warmup, decay, init_value=init, end_value=end)
    assert schedule(warmup) == np.float32(peak)
    for n in (decay, decay + 1, 5 * decay):
        assert schedule(n) == np.float32(end)
    if warmup:
        assert schedule(0) == np.float32(init)


@pytest.mark.standard_promotion  # optax's schedules multiply a Python float by an int32 count
@pytest.mark.parametrize("peak, warmup, decay, init, end", WARMUP_COSINE_CASES[:3])
def test_warmup_cosine_follows_optax_convention(peak, warmup, decay, init, end):
    ours = ro.warmup_cosine_schedule(peak, warmup, decay, init_value=init, end_value=end)
    theirs = optax.warmup_cosine_decay_schedule(init, peak, warmup, decay, end_value=end)
    counts = jnp.arange(decay + 5, dtype=jnp.int32)
    got = np.asarray(jax.vmap(ours)(counts))
    want = np.asarray(jax.vmap(theirs)(counts))
    scale = max(abs(peak), abs(init), abs(end))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * scale)


def test_schedule_rejects_float_count():
    schedule = ro.step_schedule(1.0, 2, 0.5)
    with pytest.raises(TypeError, match="integer update count"):
        schedule(jnp.float32(3.0))
    with pytest.raises(TypeError, match="integer update count"):
        ro.warmup_cosine_schedule(1.0, 2, 5)(3.0)


def test_optax_schedules_are_reexported():
    names = [
        "constant_schedule",
        "linear_schedule",
        "cosine_decay_schedule",
        "exponential_decay",
        "piecewise_constant_schedule",
        "warmup_cosine_decay_schedule",
        "join_schedules",
        "polynomial_schedule",
        "cosine_onecycle_schedule",
    ]
    for name in names:
        assert getattr(ro, name) is getattr(optax, name), name


STEP = dict(init_value=1.0, step_size=10, gamma=0.5)
COSINE = dict(peak_value=1.0, warmup_steps=1, decay_steps=10)


test_bad_step_schedule_arguments = rejects(
    ro.step_schedule,
    [
        ({"step_size": 0}, ValueError, "step_size=0"),
        ({"step_size": -3}, ValueError, "step_size=-3"),
        ({"step_size": 2.5}, TypeError, "step_size=2.5"),
        ({"step_size": True}, TypeError, "step_size=True"),
        ({"gamma": 0.0}, ValueError, "gamma=0.0"),
        ({"gamma": -0.5}, ValueError, "gamma=-0.5"),
        ({"gamma": math.inf}, ValueError, "gamma=inf"),
        ({"init_value": math.nan}, ValueError, "init_value=nan"),
        ({"init_value": "1e-3"}, TypeError, "init_value='1e-3'"),
    ],
    **STEP,
)

test_bad_warmup_cosine_arguments = rejects(
    ro.warmup_cosine_schedule,
    [
        ({"warmup_steps": -1}, ValueError, "warmup_steps=-1"),
        ({"warmup_steps": 1.0}, TypeError, "warmup_steps=1.0"),
        ({"warmup_steps": 10, "decay_steps": 10}, ValueError, "decay_steps=10, warmup_steps=10"),
        ({"warmup_steps": 10, "decay_steps": 5}, ValueError, "decay_steps=5, warmup_steps=10"),
        ({"warmup_steps": 0, "decay_steps": 0}, ValueError, "decay_steps=0"),
        ({"decay_steps": 2**31}, ValueError, "decay_steps=2147483648"),
        ({"peak_value": math.inf}, ValueError, "peak_value=inf"),
        ({"init_value": math.nan}, ValueError, "init_value=nan"),
        ({"end_value": -math.inf}, ValueError, "end_value=-inf"),
    ],
    **COSINE,
)
