"""``KVCache``: the keys and values a causal LM has computed, kept for generation."""

from __future__ import annotations

import dataclasses
import math

import jax

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values of the tokens seen so far: each prompt's once, each sample's own.

    A page table of depth two. The prefill writes each prompt's keys and values once, into
    the prompt block (B rows); each of its ``num_samples`` samples then writes its own tokens
    into its own row of the sample block (``B * num_samples`` rows, prompt-major: rows
    ``i * n .. i * n + n - 1`` are prompt ``i``'s). A sample's pages are its prompt's block
    and its own row, so the prompt's keys and values are stored (and read) once for all its
    samples, never copied: the cache's bytes are ``B * P`` prompt slots plus
    ``B * num_samples * N`` own slots per layer (``nbytes``).

    Rows are left-padded to a common length, so slot ``s`` is the same step for every row;
    the ``*_valid`` masks say which slots hold a real token (padding and unwritten slots do
    not), ``*_positions`` the RoPE position of the token in each slot. Keys and values are
    kv-head-major, ``[rows, G, slots, K]``: the layout decode attention's matmuls read
    without a copy (``rudax.kernels.decode_attention``).

    Attributes:
      prompt_keys, prompt_values: one ``[B, G, P, K]`` array per layer (G key/value heads of
        K channels); P = 0 before the prefill.
      prompt_valid: ``[B, P]`` bool.
      prompt_positions: ``[B, P]`` int32.
      sample_keys, sample_values: one ``[B * num_samples, G, N, K]`` array per layer.
      sample_valid: ``[B * num_samples, N]`` bool.
      sample_positions: ``[B * num_samples, N]`` int32.
      length: the slots written, prompt's and own, a scalar int32 (the next token's slot is
        own slot ``length - P``).
    """

    prompt_keys: tuple[jax.Array, ...]
    prompt_values: tuple[jax.Array, ...]
    prompt_valid: jax.Array
    prompt_positions: jax.Array
    sample_keys: tuple[jax.Array, ...]
    sample_values: tuple[jax.Array, ...]
    sample_valid: jax.Array
    sample_positions: jax.Array
    length: jax.Array

    @property
    def batch_size(self) -> int:
        """B, the number of prompts."""
        return int(self.prompt_valid.shape[0])

    @property
    def num_samples(self) -> int:
        """The samples per prompt."""
        return int(self.sample_valid.shape[0]) // max(self.batch_size, 1)

    @property
    def prompt_size(self) -> int:
        """P, the prompt block's slots (0 before the prefill)."""
        return int(self.prompt_valid.shape[1])

    @property
    def size(self) -> int:
        """P + N, the slots of a sample: its prompt's and its own."""
        return self.prompt_size + int(self.sample_valid.shape[1])

    @property
    def nbytes(self) -> int:
        """The bytes of the keys and values, both blocks (also of a ``jax.eval_shape`` cache)."""
        arrays = self.prompt_keys + self.prompt_values + self.sample_keys + self.sample_values
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)
