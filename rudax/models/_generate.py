"""``generate``: text from a ``rudax.models`` causal LM with a KV cache.

The prompts are left-padded to a shared length, run once (prefill: causal attention over the
prompt, its keys and values written into the cache), then one token per step (decode:
attention of the new token over the cached slots) inside one ``lax.while_loop`` that stops
when every row has met a stop token or the budget is spent. Prompt length and budget are
rounded up to powers of two (at least 16), so prompts of similar sizes share one compiled
program; the padding is masked, never attended to.

Sampling follows transformers' ``generate``: greedy (``temperature=0``), or softmax sampling
at a temperature after top-k, then top-p (nucleus) filtering of the logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["generate"]

_MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None


def _bucket(n: int) -> int:
    return max(_MIN_BUCKET, 1 << (n - 1).bit_length())


def _sample(logits_BxV: jax.Array, s: _Sampling, key: jax.Array) -> jax.Array:
    logits = logits_BxV.astype(jnp.float32)
    if s.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p is not None and s.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (the
        # most likely token always), as transformers' TopPLogitsWarper does.
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        drop_sorted = before >= s.top_p
        drop = (
            jnp.zeros_like(drop_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(drop_sorted)
        )
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "sampling"))
def _run(
    graphdef: Any,
    state: Any,
    ids_BxP: jax.Array,
    lengths_B: jax.Array,
    stops: jax.Array,
    max_new: jax.Array,
    key: jax.Array,
    *,
    steps: int,
    sampling: _Sampling,
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    b, p = ids_BxP.shape
    pad_B = p - lengths_B
    slot = jnp.arange(p)[None, :]
    real_BxP = slot >= pad_B[:, None]
    positions = jnp.where(real_BxP, slot - pad_B[:, None], 0).astype(jnp.int32)
    cache = model.init_cache(b, p + steps)
    logits, cache = model(
        ids_BxP, positions=positions, segment_ids=real_BxP.astype(jnp.int32), cache=cache
    )
    out = jnp.zeros((b, steps), jnp.int32)
    done = jnp.zeros((b,), bool)

    def cond(carry: Any) -> Any:
        step, _, done, _, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry: Any) -> Any:
        step, out, done, last_BxV, cache, key = carry
        key, sub = jax.random.split(key)
        token = _sample(last_BxV, sampling, sub)
        token = jnp.where(done, 0, token)
        out = out.at[:, step].set(token)
        done = done | jnp.any(token[:, None] == stops[None, :], axis=-1)
        pos = (lengths_B + step).astype(jnp.int32)[:, None]
        logits, cache = model(token[:, None], positions=pos, cache=cache)
        return step + 1, out, done, logits[:, -1], cache, key

    carry = (jnp.zeros((), jnp.int32), out, done, logits[:, -1], cache, key)
    step, out, done, _, _, _ = jax.lax.while_loop(cond, body, carry)
    return out, step


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: int | Sequence[int] | None = None,
    rng: jax.Array | None = None,
) -> list[list[int]]:
    """New tokens after each prompt, greedy or sampled, with a KV cache.

    Args:
      model: a ``rudax.models`` causal LM (``LlamaForCausalLM``), plain, with LoRA adapters
        (``rudax.layers.apply_lora``) or an NF4 base; it is not modified.
      prompts: token ids, one sequence per row (rows may differ in length; each at least one
        token), or a ``[B, T]`` array.
      max_new_tokens: the most tokens to add to each row, >= 1.
      temperature: 0 for greedy decoding (the argmax, as transformers' ``do_sample=False``);
        > 0 to sample from ``softmax(logits / temperature)``.
      top_k: with sampling, keep the k most likely tokens only (None: all).
      top_p: with sampling, keep the most likely tokens whose probability sums to top_p
        (None or 1.0: all).
      stop_tokens: token ids that end a row (included in its output); None for the model's
        ``config.eos_token_id``.
      rng: a ``jax.random.key`` for sampling; None for ``key(0)``.

    Returns:
      One list of new token ids per prompt, ending at its first stop token or after
      ``max_new_tokens``.

    Example:
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, generate
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=2, num_attention_heads=4)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5)
      >>> [len(row) for row in out]
      [5, 5]
    """
    if not callable(getattr(model, "init_cache", None)):
        raise TypeError(
            f"model must be a rudax.models causal LM with a KV cache (LlamaForCausalLM), got "
            f"{type(model).__name__}"
        )
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts).tolist()
    rows = [[int(t) for t in row] for row in prompts]
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("prompts must hold at least one row, each of at least one token")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    for i, row in enumerate(rows):
        bad = [t for t in row if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]}, outside [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (isinstance(temperature, int | float) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if stop_tokens is None:
        stop_tokens = getattr(config, "eos_token_id", None)
    stops = (
        []
        if stop_tokens is None
        else ([stop_tokens] if isinstance(stop_tokens, int) else list(stop_tokens))
    )
    # -1 matches no token: a fixed-size stop array keeps one program for any stop set size.
    stop_array = jnp.asarray(stops + [-1] * (8 - len(stops) % 8), jnp.int32)
    p = _bucket(max(len(row) for row in rows))
    ids = np.zeros((len(rows), p), np.int32)
    for i, row in enumerate(rows):
        ids[i, p - len(row) :] = row
    lengths = jnp.asarray([len(row) for row in rows], jnp.int32)
    sampling = _Sampling(float(temperature), top_k, None if top_p is None else float(top_p))
    graphdef, state = nnx.split(model)
    out, steps = _run(
        graphdef,
        state,
        jnp.asarray(ids),
        lengths,
        stop_array,
        jnp.asarray(max_new_tokens, jnp.int32),
        jax.random.key(0) if rng is None else rng,
        steps=_bucket(max_new_tokens),
        sampling=sampling,
    )
    out_np = np.asarray(out)[:, : int(steps)]
    result = []
    for row in out_np.tolist():
        for j, token in enumerate(row):
            if token in stops:
                row = row[: j + 1]
                break
        result.append(row)
    return result
