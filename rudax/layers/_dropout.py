"""Dropout: zero each element with probability ``rate`` and rescale the rest by 1 / (1 - rate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from rudax._validation import check_bool
from rudax.layers._validation import check_rate

# What a call's ``rngs`` may be, as flax's ``nnx.Dropout.__call__`` takes it.
RngsLike = nnx.Rngs | nnx.RngStream | jax.Array


def _key_of(rngs: RngsLike, rng_collection: str) -> jax.Array:
    """The key a mask is drawn from: the stream's next key, or the key array itself."""
    if isinstance(rngs, nnx.Rngs):
        # An Rngs without that stream falls back to its ``default`` stream, as in flax.
        return rngs[rng_collection]()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    return rngs


def _check_call_rngs(rngs: object) -> None:
    """Call-time rngs: an Rngs, an RngStream, or one PRNG key (typed, or raw uint32)."""
    if isinstance(rngs, nnx.Rngs | nnx.RngStream):
        return
    if isinstance(rngs, jax.Array):
        typed = jnp.issubdtype(rngs.dtype, jax.dtypes.prng_key)
        if (typed and rngs.ndim == 0) or (rngs.dtype == jnp.uint32 and rngs.ndim == 1):
            return
        raise TypeError(
            "rngs must be a single PRNG key (jax.random.key(seed), or a raw uint32 key), "
            f"got an array with rngs.dtype={rngs.dtype}, rngs.shape={rngs.shape}"
        )
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream, a PRNG key or None, got {rngs=}")


class Dropout(nnx.Module):
    """Inverted dropout: ``y = x * mask / (1 - rate)`` with ``mask ~ Bernoulli(1 - rate)``.

    In training (``deterministic=False``) each element is kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)``, so ``E[y] = x``; with ``deterministic=True`` (or
    ``rate == 0``) ``y = x``. As in flax, ``model.train()`` / ``model.eval()`` (and
    ``nnx.view``) set ``deterministic`` on every nested Dropout, and the call's own
    ``deterministic`` argument takes precedence over the attribute. Unlike flax, ``rate == 1``
    is refused: it would drop everything, and torch refuses ``p > 1`` only.

    The mask's randomness is flax's: the call's ``rngs`` if given, else the stream kept at
    construction. An ``nnx.Rngs`` gives the next key of its ``rng_collection`` stream (its
    ``default`` stream if it has none by that name), an ``nnx.RngStream`` its next key, a key
    array itself; so the same rngs give the same mask as ``flax.nnx.Dropout``. Call-time rngs
    leave the kept stream untouched, and ``deterministic`` or ``rate == 0`` draws no key at
    all. The mask has ``x``'s sharding, so an input sharded over an Explicit mesh axis stays
    sharded.

    The scaling is done in ``x``'s dtype: ``1 / (1 - rate)`` enters as a Python float (a weak
    type), so bf16 stays bf16 under strict dtype promotion.

    Args:
      rate: probability of zeroing an element, in [0, 1).
      deterministic: the default mode; False (training) as in flax and torch.
      rng_collection: the ``nnx.Rngs`` stream the masks are drawn from.
      rngs: an ``nnx.Rngs`` or ``nnx.RngStream``; a fork of its ``rng_collection`` stream (of
        the stream itself) is kept so that every call draws a fresh mask (its counter is
        module state, updated under ``nnx.jit``). May be None for a layer that is only ever
        called with ``deterministic=True``, with ``rate == 0``, or with ``rngs=`` at the call.

    Returns:
      A module; calling it returns an array of ``x``'s shape and dtype.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> drop = rl.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      >>> y = drop(jnp.ones((1000,)))
      >>> sorted(set(y.tolist()))
      [0.0, 2.0]
      >>> bool((drop(jnp.ones(3), deterministic=True) == 1).all())
      True
      >>> late = rl.Dropout(0.5)  # rngs at call time, as in the flax.nnx MNIST tutorial
      >>> key = jax.random.key(1)
      >>> bool((late(jnp.ones(8), rngs=key) == nnx.Dropout(0.5)(jnp.ones(8), rngs=key)).all())
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
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        self.rate = check_rate("rate", rate)
        check_bool("deterministic", deterministic)
        self.deterministic = deterministic
        self.rng_collection = rng_collection
        if isinstance(rngs, nnx.Rngs):
            self.rngs = rngs[rng_collection].fork()
        elif isinstance(rngs, nnx.RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = None
        else:
            raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or None, got {rngs=}")

    def __call__(
        self, x: jax.Array, *, deterministic: bool | None = None, rngs: RngsLike | None = None
    ) -> jax.Array:
        """Drops and rescales ``x``.

        Args:
          x: the input, any shape and floating dtype.
          deterministic: overrides the module's mode for this call (True returns ``x``).
          rngs: an ``nnx.Rngs``, ``nnx.RngStream`` or PRNG key to draw this call's mask from,
            in place of the stream kept at construction (which then does not advance).

        Returns:
          ``x`` with each element zeroed with probability ``rate`` and the rest rescaled.
        """
        x = jnp.asarray(x)
        if rngs is not None:
            _check_call_rngs(rngs)
        if deterministic is None:
            deterministic = self.deterministic
        if deterministic or self.rate == 0.0:
            return x
        if rngs is None:
            rngs = self.rngs
        if rngs is None:
            raise ValueError(
                "Dropout was built with rngs=None and the call passed none, so it can only run "
                "with deterministic=True; pass rngs=nnx.Rngs(dropout=seed) to the constructor "
                "or to the call to train with it"
            )
        keep = 1.0 - self.rate
        # The mask takes x's sharding: on an Explicit mesh axis a replicated mask could not be
        # selected against a sharded x.
        mask = jax.random.bernoulli(
            _key_of(rngs, self.rng_collection),
            keep,
            x.shape,
            out_sharding=jax.typeof(x).sharding,
        )
        return lax.select(mask, x * (1.0 / keep), jnp.zeros_like(x))

    def set_view(self, deterministic: bool | None = None) -> None:
        """Used by ``nnx.view``: sets the default mode."""
        if deterministic is not None:
            self.deterministic = deterministic
