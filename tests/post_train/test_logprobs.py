"""``token_logprobs`` against a float64 NumPy log-softmax and TRL's ``selective_log_softmax``;
``per_completion_sum`` / ``completion_token_counts`` over TRL's ``[N, L]`` layout and over
``pack_shared_prefix``'s packed rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.models as rm
from rudax.post_train import (
    IGNORE_INDEX,
    completion_token_counts,
    per_completion_sum,
    token_logprobs,
)

torch = pytest.importorskip(
    "torch", reason="torch runs TRL, the reference (the test extra pins it)"
)
trl_utils = pytest.importorskip(
    "trl.trainer.utils", reason="TRL is the post-training reference (the test extra pins it)"
)

V = 11


def _reference(logits, labels, temperature):
    """log_softmax(logits / T)[label] in float64 NumPy, 0 where the label is -100."""
    x = np.asarray(logits, np.float64) / temperature
    m = x.max(-1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    counted = labels != IGNORE_INDEX
    picked = np.take_along_axis(logp, np.where(counted, labels, 0)[..., None], -1)[..., 0]
    return np.where(counted, picked, 0.0)


def _inputs(seed=0, shape=(2, 6)):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((*shape, V))).astype(np.float32)
    labels = rng.integers(0, V, shape).astype(np.int32)
    labels[0, :2] = IGNORE_INDEX  # a prompt
    labels[1, -1] = IGNORE_INDEX  # a completion's last token
    return logits, labels


def test_ignore_index_is_the_models():
    assert IGNORE_INDEX == rm.IGNORE_INDEX == -100


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_float32_logits_match_a_float64_reference(temperature):
    logits, labels = _inputs()
    got = token_logprobs(jnp.asarray(logits), jnp.asarray(labels), temperature=temperature)
    assert got.dtype == jnp.float32 and got.shape == labels.shape
    want = _reference(logits, labels, temperature)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6)
    assert (np.asarray(got)[labels == IGNORE_INDEX] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_logits_match_trl_selective_log_softmax(temperature):
    """TRL's own function on the same float64 logits (its -100 rows masked by row_mask)."""
    logits, labels = _inputs(seed=1)
    counted = labels != IGNORE_INDEX
    want = trl_utils.selective_log_softmax(
        torch.tensor(logits, dtype=torch.float64),
        torch.tensor(np.where(counted, labels, 0), dtype=torch.long),
        temperature=temperature,
        row_mask=torch.tensor(counted),
    ).numpy()
    with jax.enable_x64(True):
        got = token_logprobs(
            jnp.asarray(logits, jnp.float64), jnp.asarray(labels), temperature=temperature
        )
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(want, _reference(logits, labels, temperature), atol=1e-12)


def test_bfloat16_logits_are_computed_in_float32():
    logits, labels = _inputs(seed=2)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    got = token_logprobs(bf16, jnp.asarray(labels), temperature=0.8)
    assert got.dtype == jnp.float32
    # the reference of the bf16 values themselves: only the logits are rounded, not the math
    want = _reference(np.asarray(bf16.astype(jnp.float32)), labels, 0.8)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6)


def test_gradient_is_zero_at_ignored_labels_and_a_softmax_elsewhere():
    logits, labels = _inputs(seed=3)
    grad = jax.grad(lambda x: token_logprobs(x, jnp.asarray(labels)).sum())(jnp.asarray(logits))
    grad = np.asarray(grad)
    counted = labels != IGNORE_INDEX
    assert (grad[~counted] == 0).all()
    # d log softmax(x)[y] / dx = onehot(y) - softmax(x)
    x = logits.astype(np.float64)
    softmax = np.exp(x - x.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    want = np.eye(V)[np.where(counted, labels, 0)] - softmax
    np.testing.assert_allclose(grad[counted], want[counted], atol=1e-6)


def _trl_layout():
    """Three completions of lengths 4, 2, 0 in TRL's [N, L] layout, padding holding NaN."""
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    completion = np.where(mask, np.arange(3)[:, None], -1).astype(np.int32)
    values = np.where(mask, np.arange(12, dtype=np.float32).reshape(3, 4), np.nan)
    return values, completion


def test_per_completion_sum_over_the_trl_layout_ignores_padding():
    values, completion = _trl_layout()
    got = per_completion_sum(jnp.asarray(values), jnp.asarray(completion), 3)
    np.testing.assert_array_equal(np.asarray(got), [0 + 1 + 2 + 3, 4 + 5, 0])
    counts = completion_token_counts(jnp.asarray(completion), 3)
    assert counts.dtype == jnp.int32 and counts.tolist() == [4, 2, 0]
    grad = jax.grad(lambda v: per_completion_sum(v, jnp.asarray(completion), 3).sum())(
        jnp.asarray(values)
    )
    np.testing.assert_array_equal(np.asarray(grad), (completion >= 0).astype(np.float32))


def test_packed_shared_prefix_rows_give_each_completion_its_own_sum():
    """token_logprobs over pack_shared_prefix's labels, summed by its ``completion``, equals
    each completion's log-probs taken one by one."""
    examples = [([5, 6, 7], [[8, 9], [10]]), ([4], [[3, 2, 1]])]
    rows = rm.pack_shared_prefix(examples, row_length=16)
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((*rows.tokens.shape, V)).astype(np.float32)
    logps = token_logprobs(jnp.asarray(logits), jnp.asarray(rows.labels), temperature=0.9)
    sums = per_completion_sum(logps, jnp.asarray(rows.completion), 3)
    counts = completion_token_counts(jnp.asarray(rows.completion), 3)
    assert counts.tolist() == [2, 1, 3]
    want = np.zeros(3)
    ref = _reference(logits, rows.labels, 0.9)
    for (b, t), i in np.ndenumerate(rows.completion):
        if i >= 0:
            want[i] += ref[b, t]
    np.testing.assert_allclose(np.asarray(sums), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0, -1.0, float("inf")])
def test_bad_temperature_is_named(temperature):
    logits, labels = _inputs()
    with pytest.raises(ValueError, match=rf"temperature must be .*got temperature={temperature}"):
        token_logprobs(logits, labels, temperature=temperature)


def test_bad_shapes_and_dtypes_are_named():
    logits, labels = _inputs()
    with pytest.raises(
        ValueError, match=r"logits_BxTxV.shape=\(2, 6, 11\) and labels_BxT.shape=\(2, 5\)"
    ):
        token_logprobs(logits, labels[:, :5])
    with pytest.raises(TypeError, match=r"labels_BxT must hold integer.*float32"):
        token_logprobs(logits, labels.astype(np.float32))
    with pytest.raises(TypeError, match=r"logits_BxTxV must be a floating array.*int32"):
        token_logprobs(labels[..., None], labels)
    values, completion = _trl_layout()
    with pytest.raises(ValueError, match=r"completion.shape=\(3, 3\) and values.shape=\(3, 4\)"):
        per_completion_sum(values, completion[:, :3], 3)
    with pytest.raises(TypeError, match=r"completion must hold integer.*float32"):
        per_completion_sum(values, completion.astype(np.float32), 3)
    with pytest.raises(ValueError, match=r"num_completions must be a positive int.*=0"):
        per_completion_sum(values, completion, 0)
    with pytest.raises(ValueError, match=r"num_completions must be a positive int.*=-2"):
        completion_token_counts(completion, -2)
