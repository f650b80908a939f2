"""Dropout: zero each element with probability ``rate`` and rescale the rest by 1 / (1 - rate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from rudax._validation import check_bool
from rudax.layers._validation import check_rate


class Dropout(nnx.Module):
    """Inverted dropout: ``y = x * mask / (1 - rate)`` with ``mask ~ Bernoulli(1 - rate)``.

    In training (``deterministic=False``) each element is kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)``, so ``E[y] = x``; with ``deterministic=True`` (or
    ``rate == 0``) ``y = x``. As in flax, ``model.train()`` / ``model.eval()`` (and
    ``nnx.view``) set ``deterministic`` on every nested Dropout, and the call's own
    ``deterministic`` argument takes precedence over the attribute. Unlike flax, ``rate == 1``
    is refused: it would drop everything, and torch refuses ``p > 1`` only.

    The scaling is done in ``x``'s dtype: ``1 / (1 - rate)`` enters as a Python float (a weak
    type), so bf16 stays bf16 under strict dtype promotion.

    Args:
      rate: probability of zeroing an element, in [0, 1).
      deterministic: the default mode; False (training) as in flax and torch.
      rng_collection: the ``nnx.Rngs`` stream the masks are drawn from.
      rngs: an ``nnx.Rngs``; a fork of its ``rng_collection`` stream is kept so that every
        call draws a fresh mask (its counter is module state, updated under ``nnx.jit``).
        May be None for a layer only ever used with ``deterministic=True`` or ``rate == 0``.

    Returns:
      A module; calling it returns an array of ``x``'s shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> drop = rl.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      >>> y = drop(jnp.ones((1000,)))
      >>> sorted(set(y.tolist()))
      [0.0, 2.0]
      >>> bool((drop(jnp.ones(3), deterministic=True) == 1).all())
      True

    References:
      Srivastava et al., `Dropout: A Simple Way to Prevent Neural Networks from Overfitting
      <https://jmlr.org/papers/v15/srivastava14a.html>`_, 2014.
    """

    def __init__(
        self,
        rate: float,
        *,
        deterministic: bool = False,
        rng_collection: str = "dropout",
        rngs: nnx.Rngs | None = None,
    ):
        self.rate = check_rate("rate", rate)
        check_bool("deterministic", deterministic)
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs or None, got {rngs=}")
        self.rngs = None if rngs is None else rngs[rng_collection].fork()

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        x = jnp.asarray(x)
        if deterministic is None:
            deterministic = self.deterministic
        if deterministic or self.rate == 0.0:
            return x
        if self.rngs is None:
            raise ValueError(
                "Dropout was built with rngs=None, so it can only run with deterministic=True; "
                "pass rngs=nnx.Rngs(dropout=seed) to train with it"
            )
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(self.rngs(), keep, x.shape)
        return lax.select(mask, x * (1.0 / keep), jnp.zeros_like(x))

    def set_view(self, deterministic: bool | None = None) -> None:
        """Used by ``nnx.view``: sets the default mode."""
        if deterministic is not None:
            self.deterministic = deterministic
