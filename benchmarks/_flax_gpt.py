"""The flax+optax reference: ``examples/lm/model.py``'s dense GPT and the trainer's update, plainly.

An independent reimplementation, written the way a flax user would without rudax: plain
``nnx.Embed`` (tied to the head through ``attend``), ``nnx.RMSNorm`` and bias-free
``nnx.Linear`` layers, one ``qkv`` projection read as ``[q | k | v]``, rotary positions in the
"rotate half" layout with float64 NumPy tables, dense causal attention, a SwiGLU MLP, the mean
next-token cross entropy in fp32, and ``optax.clip_by_global_norm`` + ``optax.adamw`` with the
trainer's schedule and decay mask (the matrices, not the norms or the embedding). Its parameters
are fp32: plain optax has no master weights, so fp32 storage *is* its master copy.

It serves twice. ``benchmarks.lm_trainer`` times it as the flax+optax baseline (``flax_arm``), and
because it computes the same function from the same weights it cross-checks the rudax model:
the bench stops if the arms' initial losses differ, and ``tests/lm/test_bench.py`` checks that
at fp32 storage its training trajectory is the trainer's. Weights travel between the models as
``flat_params``: fp32 arrays under the rudax model's dotted ``nnx`` paths, the same ``.npz``
layout ``benchmarks/_torch_gpt.py`` reads.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks._lm_arms import JaxArm
from examples.lm.model import GPTConfig


def flat_params(model: nnx.Module | nnx.State) -> dict[str, np.ndarray]:
    """``{"blocks.0.attn.qkv.kernel": fp32 array, ...}``: a model's (or a gradient state's)
    parameters by dotted path."""
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    return {".".join(map(str, path)): np.asarray(v[...], np.float32) for path, v in flat}


def rope(x_BxTxHxK: jax.Array, theta: float) -> jax.Array:
    """Rotary positions, channel ``i`` paired with ``i + K/2``, tables in float64 NumPy."""
    t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, k, 2) / k)[None, :]
    cos, sin = (jnp.asarray(f(angles)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxTxHxK.dtype)


class RefBlock(nnx.Module):
    """One pre-norm block from plain flax layers, fp32 parameters, compute in ``dtype``."""

    def __init__(self, c: GPTConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, h = c.d_model, c.mlp_hidden
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        dense = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, **kw)
        self.n_heads, self.theta = c.n_heads, c.rope_theta
        self.attn_norm = nnx.RMSNorm(d, epsilon=c.norm_eps, **kw)
        self.qkv, self.out = dense(d, 3 * d), dense(d, d)
        self.mlp_norm = nnx.RMSNorm(d, epsilon=c.norm_eps, **kw)
        self.gate, self.up, self.down = dense(d, h), dense(d, h), dense(h, d)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        qkv = self.qkv(self.attn_norm(x_BxTxD)).reshape(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = rope(qkv[:, :, 0], self.theta), rope(qkv[:, :, 1], self.theta), qkv[:, :, 2]
        scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
        scores = jnp.where(
            np.tril(np.ones((t, t), bool)), scores / np.sqrt(d // self.n_heads), -jnp.inf
        )
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        x_BxTxD = x_BxTxD + self.out(jnp.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, d))
        h = self.mlp_norm(x_BxTxD)
        return x_BxTxD + self.down(nnx.silu(self.gate(h)) * self.up(h))


class RefGPT(nnx.Module):
    """``examples/lm/model.py``'s dense GPT written with plain flax layers: the reference.

    Args:
      config: the ``GPTConfig`` (its ``param_dtype`` is ignored: parameters are fp32).
      dtype: compute dtype.
      rngs: draws the initial weights (``load`` replaces them with the rudax model's).

    Returns:
      A module; ``model(tokens_BxT)`` returns ``logits_BxTxV`` in ``dtype``.
    """

    def __init__(self, config: GPTConfig, *, dtype: Any, rngs: nnx.Rngs):
        c = config
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(c.vocab_size, c.d_model, **kw)
        self.blocks = nnx.List([RefBlock(c, dtype=dtype, rngs=rngs) for _ in range(c.n_layers)])
        self.norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, **kw)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxT)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))

    @classmethod
    def from_arrays(cls, config: GPTConfig, arrays: dict, *, dtype: Any) -> RefGPT:
        """A ``RefGPT`` holding ``arrays`` (``flat_params`` of a rudax GPT), not drawn first."""
        ref = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
        ref.load(arrays)
        return ref

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Sets every parameter from the rudax model's (``flat_params``); names must match."""
        ours = {".".join(map(str, p)): p for p, _ in nnx.to_flat_state(nnx.state(self, nnx.Param))}
        theirs = {n.replace("attn.", "").replace("mlp.", ""): n for n in arrays}
        if set(ours) != set(theirs):
            raise ValueError(f"parameters differ: {sorted(set(ours) ^ set(theirs))}")
        for name, path in ours.items():
            node = self
            for key in path[:-1]:
                node = node[key] if isinstance(key, int) else getattr(node, key)
            getattr(node, path[-1]).set_value(jnp.asarray(arrays[theirs[name]], jnp.float32))


def ref_mean_loss(model: RefGPT, batch_BxT1: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of ``batch_BxT1`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    logits = model(batch_BxT1[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch_BxT1[:, 1:]).mean()


def ref_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """clip + AdamW in plain optax with the trainer's hyperparameters, schedule and decay mask."""
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * args.min_lr_ratio
    )
    # The trainer's examples.lm.step.decay_mask: matrices decay; norms and the embedding
    # (the tied head) do not.
    mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "['embed']" not in jax.tree_util.keystr(path), params
    )
    adamw = optax.adamw(
        lr, args.beta1, args.beta2, args.eps, weight_decay=args.weight_decay, mask=mask
    )
    return optax.chain(optax.clip_by_global_norm(args.clip), adamw)


def flax_arm(args: argparse.Namespace, config: GPTConfig, arrays: dict, batch: jax.Array) -> JaxArm:
    """Plain flax+optax: ``RefGPT`` with the rudax model's weights, one donated jitted step."""
    ref = RefGPT.from_arrays(config, arrays, dtype=config.dtype)
    graphdef, params = nnx.split(ref)
    tx = ref_optimizer(args)
    loss_fn = lambda p: ref_mean_loss(nnx.merge(graphdef, p), batch)

    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))

    def run(state):
        *state, loss = step(*state)
        return tuple(state), loss

    return JaxArm(run, (params, tx.init(params)), float)
