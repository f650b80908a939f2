"""``causal_lm_token_logprobs``: each label's log-probability under a causal LM, chunked.

Post-training losses (DPO, GRPO: ``rudax.post_train``) are functions of ``log pi(label |
context)`` at every completion token, for the policy and for its reference. Taken from the
model's logits, that is a ``[B, T, V]`` fp32 array (600 KB per token for a 150k vocabulary)
and its softmax; here the head is applied to ``chunk`` tokens at a time, as
``causal_lm_loss_sum`` does for the summed loss, and under ``jax.grad`` each chunk's logits
are recomputed in the backward pass (``jax.checkpoint``) instead of kept: XLA's scratch
memory holds about two ``[chunk, V]`` fp32 arrays, not ``[B * T, V]`` ones
(tests/models/test_token_logprobs.py reads XLA's own accounting of it).

The arithmetic after the head is the sampler's (``rudax.models.generate``'s log-probs), in
the same order: the logits in fp32 (rounded to the head's compute dtype first, as
``rudax.kernels.linear_cross_entropy`` makes them), shifted by their maximum, divided by the
temperature, then the label's entry minus the ``logsumexp``. Sampler and trainer log-probs
are compared on every batch (marin#1879 trained on log-probs taken at the wrong temperature),
so the two must differ only where their hidden states do.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rudax._validation import check_positive
from rudax.kernels._linear_cross_entropy import _fp32_logits as fp32_logits
from rudax.kernels._linear_cross_entropy import _label_masks as label_masks
from rudax.models._llama import LlamaForCausalLM
from rudax.models._loss import IGNORE_INDEX, head_inputs
from rudax.models._sampling import MAX_TEMPERATURE, MIN_TEMPERATURE

__all__ = ["causal_lm_token_logprobs"]


def causal_lm_token_logprobs(
    model: LlamaForCausalLM,
    batch: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> jax.Array:
    """The log-probability of each label under ``softmax(logits / temperature)``, ``[B, T]``.

    ``batch`` is ``causal_lm_loss_sum``'s: integer ``[B, T]`` arrays ``tokens`` and
    ``labels`` (the next token of the same example, or ``-100``, ``IGNORE_INDEX``, where
    nothing is scored), optionally ``segment_ids``, ``branch_ids`` (``pack_shared_prefix``'s
    rows) and ``positions``. With ``T`` the temperature and ``m`` a row's largest logit::

        h        = model.hidden_states(tokens, segment_ids=..., branch_ids=..., positions=...)
        logits   = float32(c(h) @ c(lm_head).T)           c: the head's compute dtype
        z        = (logits - m) / T
        logp     = z[label] - logsumexp(z)                where label != -100
        logp     = 0                                       where label == -100

    which is ``rudax.post_train.token_logprobs(model(tokens, ...), labels, temperature=T)``
    (TRL's ``selective_log_softmax``) within fp32 rounding, and, operation for operation,
    ``rudax.models.generate``'s log-probs of its sampled tokens (the shift before the
    division is the sampler's). The logits are made ``chunk`` tokens at a time (over the
    ``B * T`` tokens, crossing rows) and never held whole; under ``jax.grad`` each chunk's
    are recomputed in the backward pass. Gradients are autodiff's through the same formula:
    those of the full-logits reference up to float summation order (the head's gradient is
    summed over the chunks in its storage dtype). A label that is neither -100 nor in
    ``[0, vocab_size)`` gives NaN there, as ``linear_cross_entropy`` does, and is never read
    out of bounds.

    Args:
      model: a ``LlamaForCausalLM`` (plain, LoRA, NF4 + LoRA, Mixtral, scanned layers), or
        its ``shard``ed form inside ``jax.shard_map`` (then the log-probs of this rank's
        rows). For a LoRA model's reference policy, call it inside
        ``rudax.layers.adapters_disabled(model)``.
      batch: ``causal_lm_loss_sum``'s batch dict, checked as it checks it.
      temperature: the sampling temperature the completions were drawn at: a finite Python
        number in float32's normal range (``generate``'s own bounds), 1.0 for the model's
        own distribution. It enters the compiled program as a value: a new one reuses it.
      chunk: tokens per chunk of the head, a positive int (static: each value compiles its
        own program).

    Returns:
      ``[B, T]`` float32 log-probabilities, 0 (with zero gradient) where the label is -100.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_token_logprobs
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=1, num_attention_heads=4)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> batch = {  # a 3-token prompt and its 2-token completion
      ...     "tokens": jnp.array([[5, 6, 7, 8, 9]]),
      ...     "labels": jnp.array([[-100, -100, 8, 9, -100]]),
      ... }
      >>> logp = causal_lm_token_logprobs(model, batch, temperature=0.7, chunk=2)
      >>> logp.shape, logp.dtype, bool((logp[0, 2:4] < 0).all()), float(logp[0, 0])
      ((1, 5), dtype('float32'), True, 0.0)

    References:
      TRL's ``selective_log_softmax`` and ``GRPOTrainer._get_per_token_logps_and_entropies``
      (the logits divided by the sampling temperature),
      https://github.com/huggingface/trl/blob/main/trl/trainer/grpo_trainer.py.
    """
    temperature = _check_temperature(temperature)
    h, head, labels, _ = head_inputs(model, batch, chunk)
    b, t, d = h.shape
    # Token ids are far below 2**31: int32 holds every label, and -100 in any signed width.
    labels = labels.astype(jnp.int32)
    logp = _chunked_logprobs(
        h.reshape(b * t, d),
        head.embedding[...],
        labels.reshape(b * t),
        jnp.asarray(temperature, jnp.float32),
        chunk=chunk,
        dtype=np.dtype(h.dtype if head.dtype is None else head.dtype),
    )
    return logp.reshape(b, t)


def _check_temperature(temperature: Any) -> float:
    """A Python number in float32's normal range, as ``generate`` samples at."""
    t = check_positive("temperature", temperature, accept="static")
    if not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        # Below float32's smallest normal number XLA flushes the divisor to zero.
        raise ValueError(
            f"temperature must be in float32's normal range [{MIN_TEMPERATURE:.8g}, "
            f"{MAX_TEMPERATURE:.8g}], as generate samples at, got {temperature=!r}"
        )
    return t


def _chunk_logprobs(
    h_CxD: jax.Array, table_VxD: jax.Array, labels_C: jax.Array, temperature: jax.Array, dtype: Any
) -> jax.Array:
    """One chunk's log-probs, fp32 ``[C]``: ``rudax.models._sampling.sample``'s arithmetic."""
    logits = fp32_logits(jnp.einsum("nd,vd->nv", h_CxD.astype(dtype), table_VxD.astype(dtype)))
    # The sampler's order: shifted, then divided. The shift's own gradient is exactly zero
    # in theory (softmax sums to one) and not computed in practice (log_softmax's choice).
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    z = (logits - shift) / temperature
    counted, in_range, safe = label_masks(labels_C, table_VxD.shape[0], IGNORE_INDEX)
    picked = jnp.take_along_axis(z, safe[:, None], axis=-1)[:, 0]
    # `where`, not a product with the mask: an ignored token is an exact 0 with a zero
    # gradient whatever its logits are, and an out-of-range label a visible NaN.
    logp = picked - jax.nn.logsumexp(z, axis=-1)
    return jnp.where(counted, jnp.where(in_range, logp, jnp.nan), 0.0)


@functools.partial(jax.jit, static_argnames=("chunk", "dtype"))
def _chunked_logprobs(
    h_NxD: jax.Array,
    table_VxD: jax.Array,
    labels_N: jax.Array,
    temperature: jax.Array,
    *,
    chunk: int,
    dtype: np.dtype,
) -> jax.Array:
    """``_chunk_logprobs`` over the full chunks (one ``lax.map``), then the remainder.

    Each chunk is a ``jax.checkpoint``: autodiff keeps its inputs (the chunk's hidden states,
    the table shared by all) and recomputes its logits in the backward pass, so no chunk's
    ``[chunk, V]`` logits outlive it. ``lax.map`` runs the chunks one after the other (a
    scan: XLA's CPU schedule kept every chunk of an unrolled loop alive at once).
    """
    n, d = h_NxD.shape
    one = functools.partial(_chunk_logprobs, dtype=dtype)
    full = n - n % chunk
    parts = []
    if full:
        # Inside a scan the recomputation needs no barrier against CSE (jax.checkpoint's
        # prevent_cse); the remainder, outside it, keeps the barrier.
        each = jax.checkpoint(one, prevent_cse=False)
        xs = (h_NxD[:full].reshape(full // chunk, chunk, d), labels_N[:full].reshape(-1, chunk))
        mapped = jax.lax.map(lambda x: each(x[0], table_VxD, x[1], temperature), xs)
        parts.append(mapped.reshape(full))
    if full < n:
        parts.append(jax.checkpoint(one)(h_NxD[full:], table_VxD, labels_N[full:], temperature))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
