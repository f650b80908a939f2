"""TrainingRecord: capture holds the parts as given and refuses what cannot be stored."""

import enum
import json

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


class _Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "leaf, message",
    [
        (object(), r"state\['f'\] must be an array or a bool/int/float/str, got object"),
        # JSON would give it back as a plain int: refused rather than changed.
        (_Color.RED, r"state\['f'\] must be an array or a bool/int/float/str, got _Color"),
        (np.array([object()]), r"state\['f'\] has dtype=object"),
    ],
)
def test_capture_refuses_unstorable_state_leaves_naming_the_path(leaf, message):
    params, opt_state, _ = _parts()
    with pytest.raises(TypeError, match=message):
        rc.TrainingRecord.capture(model=params, optimizer=opt_state, state={"f": leaf})


def test_capture_requires_keywords():
    params, opt_state, _ = _parts()
    with pytest.raises(TypeError):
        rc.TrainingRecord.capture(params, opt_state)  # type: ignore[misc]


CONFIG = {
    "optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8},
    "schedule": {"name": "warmup_cosine", "warmup": 100, "total": 2000, "final": None},
    "fused": False,
}


def test_config_is_static_data_not_leaves():
    params, opt_state, acc = _parts()
    record = rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, config=CONFIG
    )
    without = rc.TrainingRecord.capture(model=params, optimizer=opt_state, accumulator=acc)
    assert len(jax.tree.leaves(record)) == len(jax.tree.leaves(without))
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(record))

    traces = []

    @jax.jit
    def step(r):
        traces.append(r.config)  # runs once per compilation
        return jax.tree.map(lambda x: x + 1, r)

    out = step(record)
    assert out.config == CONFIG and isinstance(out, rc.TrainingRecord)
    # An equal config in another dict object is the same static data: no second trace.
    twin = rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, config=json.loads(json.dumps(CONFIG))
    )
    step(twin)
    assert len(traces) == 1
    changed = rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, config={**CONFIG, "fused": True}
    )
    step(changed)
    assert len(traces) == 2
    assert jax.tree.structure(record) != jax.tree.structure(changed)


def test_capture_copies_the_config():
    params, opt_state, _ = _parts()
    config = {"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}}
    record = rc.TrainingRecord.capture(model=params, optimizer=opt_state, config=config)
    config["optimizer"]["lr"] = 0.2
    config["optimizer"]["betas"].append(0.5)
    assert record.config == {"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}}


@pytest.mark.parametrize(
    "config, error, message",
    [
        ({"lr": np.float32(1e-3)}, TypeError, r"config\['lr'\] must be .* got float32"),
        ({"betas": (0.9, 0.99)}, TypeError, r"config\['betas'\] .*use a list"),
        ({"a": {"b": [1, object()]}}, TypeError, r"config\['a'\]\['b'\]\[1\]"),
        ({"layers": {3: "x"}}, TypeError, r"config\['layers'\] has a key that is not a str: 3"),
        ({"lr": float("nan")}, ValueError, r"config\['lr'\] must be a finite float.*nan"),
        ({"clip": float("inf")}, ValueError, r"config\['clip'\] must be a finite float.*inf"),
        ([0.1], TypeError, r"config must be a dict .*got list"),
    ],
)
def test_capture_refuses_a_config_that_is_not_json_data(config, error, message):
    params, opt_state, _ = _parts()
    with pytest.raises(error, match=message):
        rc.TrainingRecord.capture(model=params, optimizer=opt_state, config=config)


def test_capture_with_dtypes_records_every_floating_leaf():
    params = {"emb": jnp.zeros((2, 3), jnp.bfloat16), "w": jnp.zeros(3, jnp.float16)}
    opt_state = ro.fp32_master(ro.adamw(1e-3)).init(params)
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    state = {"key": jax.random.key_data(jax.random.key(0)), "loss": np.float32(0.5), "pos": 3.5}
    record = rc.TrainingRecord.capture_with_dtypes(
        model=params, optimizer=opt_state, accumulator=acc, state=state
    )
    # fp32_master(adamw) state: (masters, (adam count/mu/nu, ...)); the ints and the Python
    # float are not floating arrays and are not recorded.
    expected = {
        "model['emb']": "bfloat16",
        "model['w']": "float16",
        "accumulator.sums['emb']": "float32",
        "accumulator.sums['w']": "float32",
        "accumulator.total_weight": "float32",
        "state['loss']": "float32",
    }
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            expected["optimizer" + jax.tree_util.keystr(path)] = "float32"
    assert any(k.startswith("optimizer.master") for k in expected)
    assert record.dtypes == expected
    assert rc.TrainingRecord.capture(model=params, optimizer=opt_state).dtypes is None


def test_capture_takes_typed_prng_keys():
    # Refused before issue 11; now stored as key data (tests/checkpoint/test_prng_keys.py).
    params, opt_state, _ = _parts()
    key = jax.random.key(0)
    record = rc.TrainingRecord.capture(model=params, optimizer=opt_state, state={"rng": key})
    assert record.state["rng"] is key
