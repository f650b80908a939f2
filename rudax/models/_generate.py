"""``generate``: text from a ``rudax.models`` causal LM with a KV cache, G samples per prompt.

The prompts are left-padded to a shared length and run once (prefill: causal attention over
the prompt, its keys and values written to the cache's prompt block), then one token per
sample per step (decode: attention of each sample's new token over its prompt's block and its
own slots) inside one ``lax.while_loop`` that stops when every row has met a stop token or
the budget is spent. A prompt's ``num_samples`` continuations share its block: the prompt is
computed once and its keys and values stored once, never copied per sample (``KVCache``).
Prompt length and budget are rounded up to powers of two (at least 16), so prompts of similar
sizes share one compiled program; the padding is masked, never attended to.

Sampling follows transformers' ``generate``: greedy (``temperature=0``), or softmax sampling
at a temperature after top-k, then top-p (nucleus) filtering of the logits. The temperature,
k and p are traced values of the compiled program: a new value does not recompile. This
module checks the arguments and reads the result; the compiled program is ``_decode.py``'s.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, overload

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rudax.sharding as rs
from rudax.models._decode import bucket, fsdp_placement, prefill, run, run_fsdp
from rudax.models._kv_cache import KVCache
from rudax.models._sampling import Mode, check_temperature

__all__ = ["Generation", "generate"]

# The most new tokens a call takes: the budget is rounded up to a power of two, and a
# position (prompt length + step) must stay an int32.
MAX_NEW_TOKENS = 2**30


class Generation(NamedTuple):
    """``generate(..., return_logprobs=True)``'s result: the tokens and their log-probabilities.

    Attributes:
      tokens: one list of new token ids per row, as ``generate`` returns them.
      logprobs: for each token, ``log_softmax(logits / temperature)`` at it: its
        log-probability under the unfiltered distribution at the sampling temperature (at
        temperature 1 when greedy), the number a trainer's forward recomputes.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]


@overload
def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    stop_tokens: int | Sequence[int] | None = ...,
    rng: jax.Array | None = ...,
    num_samples: int = ...,
    return_logprobs: Literal[False] = ...,
) -> list[list[int]]: ...
@overload
def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = ...,
    top_k: int | None = ...,
    top_p: float | None = ...,
    stop_tokens: int | Sequence[int] | None = ...,
    rng: jax.Array | None = ...,
    num_samples: int = ...,
    return_logprobs: Literal[True],
) -> Generation: ...
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
    num_samples: int = 1,
    return_logprobs: bool = False,
) -> list[list[int]] | Generation:
    """New tokens after each prompt, greedy or sampled, ``num_samples`` per prompt, with a
    KV cache in which a prompt's keys and values are shared by its samples.

    The prompts are prefilled once; each prompt's keys and values are stored once, in the
    cache's prompt block, and every one of its samples attends to that block (one batched
    matmul reads it for all of them) and to its own generated tokens: a page table of depth
    two (``KVCache``). The cache holds ``B * P + B * num_samples * N`` slots per layer (P
    the padded prompt length, N the padded budget), not ``B * num_samples * (P + N)``.

    Sampling draws from ``softmax(filtered(logits / temperature))``, the filters being
    transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper``. The temperature, ``top_k``
    and ``top_p`` are traced values of the compiled program, so a new value reuses it; what
    shapes the program is static: greedy or not (``temperature == 0``), and whether ``top_k``
    and ``top_p`` are given (None filters nothing and skips the sort).

    Args:
      model: a ``rudax.models`` causal LM (``LlamaForCausalLM``), plain, with LoRA adapters
        (``rudax.layers.apply_lora``) or an NF4 base, per-layer or stacked; it is not modified.
        An FSDP model (``rudax.models.shard``'s or ``from_pretrained(..., mesh=)``'s form)
        generates over its mesh, each layer gathered when it runs: every process must make
        the same call, and each gets the same tokens.
      prompts: token ids (ints), one sequence per row (rows may differ in length; each at
        least one token), or an integer ``[B, T]`` array.
      max_new_tokens: the most tokens to add to each row, 1 to 2**30.
      temperature: 0 for greedy decoding (the argmax, as transformers' ``do_sample=False``);
        otherwise at least float32's smallest normal number (1.1754944e-38) to sample from
        ``softmax(logits / temperature)``.
      top_k: with sampling, keep the k most likely tokens only (None: all).
      top_p: with sampling, keep the most likely tokens whose probability sums to top_p
        (None or 1.0: all).
      stop_tokens: token ids that end a row (included in its output): an int or a sequence
        of ints (NumPy and JAX integers, and 0-d or 1-d integer arrays, too); None for the
        model's ``config.eos_token_id``.
      rng: a ``jax.random.key`` for sampling; None for ``key(0)``.
      num_samples: G, the continuations of each prompt, an int >= 1 (transformers'
        ``num_return_sequences``).
      return_logprobs: also return each token's log-probability: ``log_softmax(logits /
        temperature)`` at the token, over the logits before top-k/top-p filtering (at
        temperature 1 when greedy). That is what a trainer recomputes from its own forward
        (TRL's GRPOTrainer divides its logits by the sampling temperature and filters
        nothing) and vLLM's ``processed_logprobs`` without the filters, so sampler and
        trainer can be compared token for token.

    Returns:
      One list of new token ids per row, ending at its first stop token or after
      ``max_new_tokens``; the rows prompt-major: ``B * G`` rows, rows ``i * G .. i * G + G -
      1`` prompt ``i``'s samples. With ``return_logprobs``, a ``Generation`` of those tokens
      and their log-probabilities.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from rudax.models import LlamaConfig, LlamaForCausalLM, generate
      >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
      ...                      num_hidden_layers=2, num_attention_heads=4)
      >>> model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
      >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5)
      >>> [len(row) for row in out]
      [5, 5]
      >>> # 3 samples of each prompt, sharing the prompt's keys and values
      >>> samples = generate(model, [[1, 2, 3], [4, 5]], 5, temperature=1.0, num_samples=3,
      ...                    rng=jax.random.key(1), return_logprobs=True)
      >>> len(samples.tokens), len(samples.logprobs[0])
      (6, 5)
    """
    needs = ("init_cache", "hidden_states", "lm_head")  # the cache, the prefill, its logits
    if not all(callable(getattr(model, a, None)) for a in needs):
        raise TypeError(
            f"model must be a rudax.models causal LM with a KV cache (LlamaForCausalLM), got "
            f"{type(model).__name__}"
        )
    config = getattr(model, "config", None)
    rows = _check_prompts(prompts, getattr(config, "vocab_size", None))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(
            f"max_new_tokens must be at most 2**30 = {MAX_NEW_TOKENS:,} (the cache holds the "
            f"next power of two of slots, and positions are int32), got {max_new_tokens:,}"
        )
    temperature = check_temperature(temperature)
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1
    ):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (
        isinstance(top_p, numbers.Real) and not isinstance(top_p, bool) and 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral):
        raise TypeError(f"num_samples must be an int, got {num_samples=!r}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples=}")
    if not isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs must be a bool, got {return_logprobs=!r}")
    if stop_tokens is None:
        stop_tokens = getattr(config, "eos_token_id", None)
    stops = _check_stop_tokens(stop_tokens)
    # -1 matches no token: a fixed-size stop array keeps one program for any stop set size.
    stop_array = jnp.asarray(stops + [-1] * (8 - len(stops) % 8), jnp.int32)
    ids, lengths = _pad(rows)
    greedy = temperature == 0.0
    mode = Mode(greedy, not greedy and top_k is not None, not greedy and top_p is not None)
    graphdef, state = nnx.split(model)
    inputs = (
        ids,
        lengths,
        stop_array,
        jnp.asarray(max_new_tokens, jnp.int32),
        jax.random.key(0) if rng is None else rng,
        jnp.asarray(1.0 if greedy else temperature, jnp.float32),
        jnp.asarray(min(int(top_k or 1), 2**31 - 1), jnp.int32),
        jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
    )
    static = dict(steps=bucket(max_new_tokens), num_samples=int(num_samples), mode=mode)
    placement = fsdp_placement(model)
    if placement is None:
        out, logps, steps = run(graphdef, state, *inputs, **static)
    else:
        mesh, axis = placement
        # Every process passes the same inputs: each made one array replicated over the whole
        # mesh, of every process's devices, as a multi-process jit takes them.
        placed = [rs.replicate(x, mesh) for x in inputs]
        out, logps, steps = run_fsdp(graphdef, state, *placed, mesh=mesh, axis=axis, **static)
        out, logps, steps = (x.addressable_data(0) for x in (out, logps, steps))
    n = int(steps)
    tokens, logprobs = [], []
    out_rows, logp_rows = np.asarray(out)[:, :n].tolist(), np.asarray(logps)[:, :n].tolist()
    for row, row_logps in zip(out_rows, logp_rows, strict=True):
        for j, token in enumerate(row):
            if token in stops:
                row, row_logps = row[: j + 1], row_logps[: j + 1]
                break
        tokens.append(row)
        logprobs.append(row_logps)
    return Generation(tokens, logprobs) if return_logprobs else tokens


def _check_prompts(prompts: Any, vocab: int | None) -> list[list[int]]:
    """The prompts as lists of Python ints; a float or bool id is refused, never truncated."""
    if isinstance(prompts, np.ndarray | jax.Array):
        array = np.asarray(prompts)
        if array.dtype.kind not in "iu":
            raise TypeError(
                f"prompts must hold integer token ids, got an array of dtype {array.dtype}"
            )
        if array.ndim != 2:
            raise ValueError(f"prompts must be a [batch, time] array, got shape {array.shape}")
        prompts = array.tolist()
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of token id rows, got {prompts!r}")
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, np.ndarray | jax.Array) and np.asarray(row).dtype.kind not in "iu":
            raise TypeError(f"prompts[{i}] must hold integer token ids, got dtype {row.dtype}")
        if isinstance(row, str | bytes) or not isinstance(row, Sequence | np.ndarray | jax.Array):
            raise TypeError(f"prompts[{i}] must be a sequence of token ids, got {row!r}")
        row = np.asarray(row).tolist() if isinstance(row, np.ndarray | jax.Array) else row
        for j, t in enumerate(row):
            if isinstance(t, bool | np.bool_) or not isinstance(t, numbers.Integral):
                raise TypeError(f"prompts[{i}][{j}] must be an int token id, got {t!r}")
        rows.append([int(t) for t in row])
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("prompts must hold at least one row, each of at least one token")
    for i, row in enumerate(rows):
        bad = [t for t in row if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"prompts[{i}] holds token id {bad[0]}, outside [0, {vocab})")
    return rows


def _check_stop_tokens(stop_tokens: Any) -> list[int]:
    """The stop tokens as Python ints: None, an int, or a sequence or array of them (NumPy
    and JAX integers and 0-d or 1-d integer arrays too); a float or bool is refused."""
    if stop_tokens is None:
        return []
    if isinstance(stop_tokens, np.ndarray | jax.Array | np.generic):
        array = np.asarray(stop_tokens)
        if array.dtype.kind not in "iu" or array.ndim > 1:
            raise TypeError(
                f"stop_tokens must be an int or a sequence of int token ids, got an array of "
                f"dtype {array.dtype} and shape {array.shape}"
            )
        stop_tokens = array.tolist()
    values = [stop_tokens] if isinstance(stop_tokens, numbers.Number) else stop_tokens
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"stop_tokens must be an int or a sequence of ints, got {stop_tokens!r}")
    stops = []
    for t in values:
        if isinstance(t, bool | np.bool_) or not isinstance(t, numbers.Integral):
            raise TypeError(f"stop_tokens must hold int token ids, got {t!r} in {stop_tokens!r}")
        if not 0 <= int(t) < 2**31:
            raise ValueError(f"stop_tokens must hold token ids in [0, 2**31), got {int(t)}")
        stops.append(int(t))
    return stops


def _pad(rows: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    """The rows left-padded with 0 to a bucketed length ``[B, P]``, and their lengths."""
    p = bucket(max(len(row) for row in rows))
    ids = np.zeros((len(rows), p), np.int32)
    for i, row in enumerate(rows):
        ids[i, p - len(row) :] = row
    return jnp.asarray(ids), jnp.asarray([len(row) for row in rows], jnp.int32)


def _cache_shapes(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    num_samples: int = 1,
) -> KVCache:
    """The cache ``generate``'s prefill makes for these arguments, as ``jax.ShapeDtypeStruct``
    leaves (``jax.eval_shape``: nothing runs); ``.nbytes`` is its keys' and values' bytes."""
    ids, lengths = _pad(_check_prompts(prompts, None))
    graphdef, state = nnx.split(model)

    def cache(state: Any, ids: jax.Array, lengths: jax.Array) -> KVCache:
        model = nnx.merge(graphdef, state)
        steps = bucket(max_new_tokens)
        return prefill(model, ids, lengths, steps=steps, num_samples=num_samples)[1]

    return jax.eval_shape(cache, state, ids, lengths)
