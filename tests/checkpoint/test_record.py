"""TrainingRecord: capture holds the parts as given and refuses what cannot be stored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.checkpoint as rc
import rudax.optim as ro


def _parts():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    tx = ro.adamw(1e-3)
    return params, tx.init(params), ro.GradientAccumulator.init(params)


def test_capture_holds_the_parts_without_copies():
    params, opt_state, acc = _parts()
    state = {"key": jax.random.key_data(jax.random.key(0)), "pos": 7, "name": "run"}
    record = rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, state=state
    )
    assert record.model is params
    assert record.optimizer is opt_state
    assert record.accumulator is acc
    assert record.state is state


def test_record_is_a_pytree():
    params, opt_state, acc = _parts()
    record = rc.TrainingRecord.capture(model=params, optimizer=opt_state, accumulator=acc)
    doubled = jax.jit(lambda r: jax.tree.map(lambda x: x + x, r))(record)
    assert isinstance(doubled, rc.TrainingRecord)
    np.testing.assert_array_equal(doubled.model["w"], 2 * np.ones((2, 3), np.float32))


def test_capture_refuses_a_non_accumulator():
    params, opt_state, _ = _parts()
    with pytest.raises(TypeError, match="accumulator"):
        rc.TrainingRecord.capture(model=params, optimizer=opt_state, accumulator={"x": 1})


def test_capture_refuses_non_array_model_leaves_naming_the_path():
    _, opt_state, _ = _parts()
    with pytest.raises(TypeError, match=r"model\['layer'\]\['w'\]"):
        rc.TrainingRecord.capture(model={"layer": {"w": [1.0]}}, optimizer=opt_state)


def test_capture_refuses_unstorable_state_leaves_naming_the_path():
    params, opt_state, _ = _parts()
    with pytest.raises(TypeError, match=r"state\['f'\]"):
        rc.TrainingRecord.capture(model=params, optimizer=opt_state, state={"f": object()})


def test_capture_requires_keywords():
    params, opt_state, _ = _parts()
    with pytest.raises(TypeError):
        rc.TrainingRecord.capture(params, opt_state)  # type: ignore[misc]
