"""Tests of rudax.optim's schedules against plain Python formulas and optax."""

import inspect
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


def warmup_cosine_reference(n, init, peak, warmup, decay, end, exponent) -> float:
    if n < warmup:
        return init + (peak - init) * n / warmup
    t = min(n - warmup, decay - warmup) / (decay - warmup)
    return end + (peak - end) * (0.5 * (1.0 + math.cos(math.pi * t))) ** exponent


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
    # optax's positional order: init, peak, warmup, decay, end, exponent
    (0.0, 1.0, 10, 110, 0.0, 1.0),
    (1e-5, 3e-4, 5, 23, 2e-5, 1.0),
    (0.0, 0.5, 0, 17, 0.1, 1.0),  # no warmup: starts at the peak
    (0.1, 1.0, 3, 20, 0.05, 2.0),  # a squared cosine
    (0.0, 2.0, 4, 9, 0.5, 0.5),
    (0.2, 0.0, 4, 12, 0.3, 1.0),  # zero peak: optax would ignore end_value here
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("init, peak, warmup, decay, end, exponent", WARMUP_COSINE_CASES)
def test_warmup_cosine_matches_reference(mode, init, peak, warmup, decay, end, exponent):
    schedule = ro.warmup_cosine_decay_schedule(init, peak, warmup, decay, end, exponent)
    counts = [*range(decay + 3), decay + 100, 10**6]
    got = evaluate(schedule, counts, mode)
    want = [warmup_cosine_reference(n, init, peak, warmup, decay, end, exponent) for n in counts]
    # fp32 cos near pi has an absolute error of a few 1e-8; scale that by the value range.
    scale = max(abs(peak), abs(init), abs(end))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.parametrize("init, peak, warmup, decay, end, exponent", WARMUP_COSINE_CASES)
def test_warmup_cosine_hits_peak_and_end_exactly(init, peak, warmup, decay, end, exponent):
    schedule = ro.warmup_cosine_decay_schedule(init, peak, warmup, decay, end, exponent)
    assert schedule(warmup) == np.float32(peak)
    for n in (decay, decay + 1, 5 * decay):
        assert schedule(n) == np.float32(end)
    if warmup:
        assert schedule(0) == np.float32(init)


@pytest.mark.standard_promotion  # optax's schedules multiply a Python float by an int32 count
@pytest.mark.parametrize("init, peak, warmup, decay, end, exponent", WARMUP_COSINE_CASES[:5])
@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_warmup_cosine_in_optax_order_gives_optax_values(
    call, init, peak, warmup, decay, end, exponent
):
    """A user who types optax's call (positionally or by keyword) gets optax's values."""
    if call == "positional":
        args, kwargs = (init, peak, warmup, decay, end, exponent), {}
    else:
        args, kwargs = (
            (),
            dict(
                init_value=init,
                peak_value=peak,
                warmup_steps=warmup,
                decay_steps=decay,
                end_value=end,
                exponent=exponent,
            ),
        )
    ours = ro.warmup_cosine_decay_schedule(*args, **kwargs)
    theirs = optax.warmup_cosine_decay_schedule(*args, **kwargs)
    counts = jnp.arange(decay + 5, dtype=jnp.int32)
    got = np.asarray(jax.vmap(ours)(counts))
    want = np.asarray(jax.vmap(theirs)(counts))
    scale = max(abs(peak), abs(init), abs(end))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.standard_promotion
def test_warmup_cosine_honours_end_value_at_zero_peak():
    """optax decays relative to the peak, so a zero peak drops end_value; rudax keeps it."""
    init, peak, warmup, decay, end = 0.2, 0.0, 4, 12, 0.3
    ours = ro.warmup_cosine_decay_schedule(init, peak, warmup, decay, end)
    theirs = optax.warmup_cosine_decay_schedule(init, peak, warmup, decay, end)
    assert float(ours(decay)) == np.float32(end)
    assert float(theirs(decay)) == 0.0


def test_one_name_per_schedule():
    """No second spelling of a schedule: the old rudax-only name is gone."""
    assert not hasattr(ro, "warmup_cosine_schedule")
    assert "warmup_cosine_schedule" not in ro.__all__


def test_schedule_rejects_float_count():
    schedule = ro.step_schedule(1.0, 2, 0.5)
    with pytest.raises(TypeError, match="integer update count"):
        schedule(jnp.float32(3.0))
    with pytest.raises(TypeError, match="integer update count"):
        ro.warmup_cosine_decay_schedule(0.0, 1.0, 2, 5)(3.0)


OPTAX_SCHEDULES = [
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "piecewise_constant_schedule",
    "join_schedules",
    "polynomial_schedule",
    "cosine_onecycle_schedule",
]


@pytest.mark.parametrize("name", OPTAX_SCHEDULES)
def test_optax_schedules_are_reexported(name):
    assert getattr(ro, name) is getattr(optax, name), name


def parameters(fn) -> list[tuple]:
    """Each parameter's name, kind and default: what a call may pass, and where."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_optax_named_schedule_takes_optax_signature():
    """A name rudax.optim shares with optax is optax's function, or takes the same parameters
    in the same order with the same defaults: optax's call, typed as is, works."""
    shared = [n for n in ro.__all__ if hasattr(optax, n)]
    schedules = [n for n in shared if "schedule" in n or n == "exponential_decay"]
    assert set(schedules) == {*OPTAX_SCHEDULES, "warmup_cosine_decay_schedule"}
    for name in schedules:
        ours, theirs = getattr(ro, name), getattr(optax, name)
        if ours is not theirs:
            assert parameters(ours) == parameters(theirs), name


STEP = dict(init_value=1.0, step_size=10, gamma=0.5)
COSINE = dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=10)


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
    ro.warmup_cosine_decay_schedule,
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
        ({"exponent": 0.0}, ValueError, "exponent=0.0"),
        ({"exponent": math.nan}, ValueError, "exponent=nan"),
        ({"init_value": "0"}, TypeError, "init_value='0'"),
    ],
    **COSINE,
)
