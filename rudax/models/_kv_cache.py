"""``KVCache``: the keys and values a causal LM has computed, kept for generation."""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["KVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values of the tokens seen so far, in slots shared by every row.

    Rows are left-padded to a common length, so slot ``s`` is the same step for every row;
    ``valid`` says which slots hold a real token of a row (padding and unwritten slots do
    not), ``positions`` the RoPE position of the token in each slot.

    Attributes:
      keys, values: one ``[B, S, G, K]`` array per layer (G key/value heads of K channels).
      valid: ``[B, S]`` bool.
      positions: ``[B, S]`` int32.
      length: the number of slots written, a scalar int32 (the next token's slot).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array
    positions: jax.Array
    length: jax.Array

    @property
    def size(self) -> int:
        """S, the number of slots."""
        return int(self.valid.shape[1])
