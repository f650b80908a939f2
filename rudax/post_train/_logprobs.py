"""Per-token log-probabilities, and their sums per completion over any layout.

Post-training losses are functions of ``log pi(token | context)`` at each completion token.
Those tokens sit either one completion per row (TRL's ``[N, L]`` with a completion mask) or
packed, several completions per row with a shared prompt (``rudax.models.pack_shared_prefix``
and its ``completion`` array: which completion a labelled position scores, -1 elsewhere).
Both layouts are described by one integer array shaped like the tokens, ``completion``, and
every per-completion quantity is a ``segment_sum`` over it: the losses never need to know
which layout they were given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from rudax._validation import check_positive, check_positive_int

__all__ = ["IGNORE_INDEX", "completion_token_counts", "per_completion_sum", "token_logprobs"]

# transformers' and torch's label of a position that is not counted (rudax.models.IGNORE_INDEX,
# written out here so that rudax.post_train, pure functions on arrays, does not import the
# models and flax with them).
IGNORE_INDEX = -100


def token_logprobs(
    logits_BxTxV: ArrayLike, labels_BxT: ArrayLike, *, temperature: float = 1.0
) -> jax.Array:
    """The log-probability of each label under ``softmax(logits / temperature)``.

    With ``x = logits / temperature`` in float32 (float64 if the logits are float64)::

        logp[b, t] = x[b, t, labels[b, t]] - logsumexp_v x[b, t, v]   where labels[b, t] != -100
        logp[b, t] = 0                                                 where labels[b, t] == -100

    This is TRL's ``selective_log_softmax(logits, labels, temperature)``. Sample and score at
    the same temperature: log-probs of the policy that generated the completions are those of
    the tempered distribution (marin#1879 trained on untempered ones by mistake).

    Memory: the logits are cast to float32 whole, one ``[B, T, V]`` array (600 KB per token
    for a 150k vocabulary, about 5 GB for 8k tokens) before the gather and the ``logsumexp``.
    That is fine for the sizes post-training runs today; a model too large for it would
    compute the log-probs from the hidden states a chunk of tokens at a time, as
    ``rudax.kernels.linear_cross_entropy`` does for the summed loss.

    Args:
      logits_BxTxV: ``[..., V]`` floating logits of any float dtype (bf16 included).
      labels_BxT: integer labels shaped like the logits without their last axis: the token
        whose log-probability is taken at each position (already shifted: the next token),
        or ``-100`` where nothing is counted. A label outside ``[0, V)`` other than -100 is
        not checkable at trace time; its log-prob is NaN (JAX fills out-of-range gathers).
      temperature: the sampling temperature, a finite number > 0.

    Returns:
      ``[...]`` log-probabilities, float32 (float64 for float64 logits), 0 where the label is
      -100 (with zero gradient there).

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.post_train import token_logprobs
      >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
      >>> token_logprobs(logits, jnp.array([[0, -100]])).tolist()
      [[-0.6931471824645996, 0.0]]
    """
    temperature = check_positive("temperature", temperature, accept="concrete")
    logits = _floating("logits_BxTxV", logits_BxTxV)
    labels = jnp.asarray(labels_BxT)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels_BxT must hold integer token ids, got dtype {labels.dtype}")
    if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            "logits_BxTxV must be labels_BxT's shape plus a vocabulary axis, got "
            f"logits_BxTxV.shape={logits.shape} and labels_BxT.shape={labels.shape}"
        )
    x = logits.astype(_compute_dtype(logits))
    if temperature != 1.0:
        # Divided, not multiplied by 1 / temperature: the same rounding as TRL and samplers.
        x = x / temperature
    counted = labels != IGNORE_INDEX
    picked = jnp.take_along_axis(x, jnp.where(counted, labels, 0)[..., None], axis=-1)[..., 0]
    # x[label] - logsumexp(x) is log_softmax(x)[label] without a second [B, T, V] array.
    return jnp.where(counted, picked - jax.nn.logsumexp(x, axis=-1), 0)


def per_completion_sum(values: ArrayLike, completion: ArrayLike, num_completions: int) -> jax.Array:
    """Sums ``values`` over the positions of each completion.

    ::

        sums[i] = sum_{positions p with completion[p] == i} values[p]     i < num_completions

    Positions with ``completion == -1`` are left out (their values, even NaN, reach no sum and
    get zero gradient). On GPU the sum is ``jax.ops.segment_sum``'s scatter-add, whose order of
    additions is not fixed: the last bits may differ from run to run.

    Args:
      values: a floating array shaped like ``completion`` (per-token log-probs, say).
      completion: integers, the completion each position belongs to, or -1. Indices must be
        in ``[-1, num_completions)``; larger ones are dropped, which cannot be checked at
        trace time.
      num_completions: the number of completions, N.

    Returns:
      ``[N]`` sums in ``values``' dtype; 0 for a completion with no position.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.post_train import per_completion_sum
      >>> values = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
      >>> per_completion_sum(values, jnp.array([[-1, 0, 0, 1, -1]]), 3).tolist()
      [5.0, 4.0, 0.0]
    """
    check_positive_int("num_completions", num_completions)
    values = _floating("values", values)
    index = _completion_index(completion, values.shape, "values")
    counted = index >= 0
    # Unlisted positions go to the segment num_completions, past the end, which segment_sum
    # drops; their values are zeroed first so that a NaN there cannot reach a gradient.
    return jax.ops.segment_sum(
        jnp.where(counted, values, 0).reshape(-1),
        jnp.where(counted, index, num_completions).reshape(-1),
        num_segments=num_completions,
    )


def completion_token_counts(completion: ArrayLike, num_completions: int) -> jax.Array:
    """The number of positions of each completion (its counted tokens), int32 ``[N]``.

    Args:
      completion: integers, the completion each position belongs to, or -1.
      num_completions: the number of completions, N.

    Returns:
      ``counts[i] = #{p : completion[p] == i}``, int32.

    Example:
      >>> import jax.numpy as jnp
      >>> from rudax.post_train import completion_token_counts
      >>> completion_token_counts(jnp.array([[-1, 0, 0, 1, -1]]), 3).tolist()
      [2, 1, 0]
    """
    check_positive_int("num_completions", num_completions)
    index = _completion_index(completion, None, None)
    return jax.ops.segment_sum(
        (index >= 0).astype(jnp.int32).reshape(-1),
        jnp.where(index >= 0, index, num_completions).reshape(-1),
        num_segments=num_completions,
    )


def row_completions(batch: Mapping[str, Any], *, group: int) -> tuple[jax.Array, int]:
    """``batch["completion"]`` (``pack_shared_prefix``'s) checked and renumbered row by row.

    Returns ``(index, per_row)``: row r's k-th completion is ``r * per_row + k`` in ``index``
    (-1 where nothing is scored), ``per_row`` the most a row can hold (each completion takes
    at least two of its tokens: itself and a copy of its prompt's last one), a multiple of
    ``group``, the completions per example (2 for DPO's pairs): a row's first completion,
    and so each example's, then starts at a multiple of ``group``.

    A row's completions are consecutive in ``pack_shared_prefix``'s numbering (over the
    whole batch), so subtracting the row's smallest gives them the same numbers in any part
    of the batch that holds the row: a device's rows inside ``jax.shard_map``, a
    microbatch's. The batch's ``B * per_row`` numbers have room for every row's.
    """
    if "completion" not in batch:
        raise KeyError(
            "batch has no 'completion': pass pack_shared_prefix's, as "
            "{**rows.batch(), 'completion': rows.completion}"
        )
    completion = jnp.asarray(batch["completion"])
    labels_shape = jnp.shape(batch["labels"])
    if completion.ndim != 2 or completion.shape != labels_shape:
        raise ValueError(
            f"batch['completion'] must be [B, T] like batch['labels'] {labels_shape}, "
            f"got shape {completion.shape}"
        )
    if not jnp.issubdtype(completion.dtype, jnp.integer):
        raise TypeError(f"batch['completion'] must be integers, got dtype {completion.dtype}")
    rows, length = completion.shape
    per_row = group * (length // (2 * group))
    if per_row == 0:
        raise ValueError(
            f"rows of T={length} tokens cannot hold an example of {group} completion(s): "
            f"it takes at least {2 * group}"
        )
    counted = completion >= 0
    big = jnp.iinfo(completion.dtype).max
    first = jnp.min(jnp.where(counted, completion, big), axis=1, keepdims=True)
    row = jnp.arange(rows, dtype=completion.dtype)[:, None]
    return jnp.where(counted, completion - first + row * per_row, -1), per_row


def _compute_dtype(*arrays: jax.Array) -> DTypeLike:
    """float64 if any of the arrays is float64, else float32: the losses' compute dtype.

    Log-probs arrive in bf16 from some models; their differences (log-ratios) and sums over
    thousands of tokens must not be taken in 8 significant bits. float64 stays float64 so
    that the tests compare with TRL in float64.
    """
    if any(a.dtype == jnp.float64 for a in arrays):
        return jnp.float64
    return jnp.float32


def _floating(name: str, value: Any) -> jax.Array:
    """value as a jax array with a floating dtype, or a TypeError naming it."""
    try:
        array = jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a floating array, got {value!r:.200}") from e
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got {name}.dtype={array.dtype}")
    return array


def _completion_index(
    completion: Any, shape: tuple[int, ...] | None, other: str | None
) -> jax.Array:
    """completion as an integer array, shaped like ``other`` (``shape``) when given."""
    index = jnp.asarray(completion)
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise TypeError(f"completion must hold integer indices, got completion.dtype={index.dtype}")
    if shape is not None and index.shape != shape:
        raise ValueError(
            f"completion must have {other}'s shape, got completion.shape={index.shape} and "
            f"{other}.shape={shape}"
        )
    return index
