"""The flax+optax reference: the trainer's Llama and its update, written plainly.

An independent reimplementation of ``rudax.models.LlamaForCausalLM`` as the trainer builds it
(``benchmarks/_trainer.py``), written the way a flax user would without rudax: plain
``nnx.Embed`` (the tied head through its ``attend``), ``nnx.RMSNorm`` and bias-free
``nnx.Linear`` layers under Hugging Face's names (``model.layers.0.self_attn.q_proj``),
separate q/k/v projections, rotary positions in the "rotate half" layout with float64 NumPy
tables, dense causal attention (grouped-query heads repeated as transformers' ``repeat_kv``),
a SwiGLU MLP, the mean next-token cross entropy over the full fp32 logits, and
``optax.clip_by_global_norm`` + ``optax.adamw`` with the trainer's schedule and decay mask
(the matrices, not the norms or the token embedding). Its parameters are fp32: plain optax
has no master weights, so fp32 storage *is* its master copy.

It serves twice. ``benchmarks.lm_trainer`` times it as the flax+optax baseline (``flax_arm``),
and because it computes the same function from the same weights it cross-checks the rudax
model: the bench stops if the arms' initial losses differ, and
``tests/benchmarks/test_lm_trainer.py`` checks that at fp32 storage its training trajectory is
the trainer's. Weights travel between the models as ``flat_params``: fp32 arrays under the
rudax model's dotted ``nnx`` paths (its Hugging Face module names), the same ``.npz`` layout
``benchmarks/_torch_llama.py`` reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rudax.models as rm
from benchmarks._lm_arms import JaxArm, check_reference_config
from benchmarks._trainer import Recipe

# Where a tied model's one table is named: transformers' checkpoints keep it there too.
EMBEDDING = "model.embed_tokens.embedding"


def flat_params(model: nnx.Module | nnx.State) -> dict[str, np.ndarray]:
    """``{"model.layers.0.self_attn.q_proj.kernel": fp32 array, ...}``: a model's (or a
    gradient state's) parameters by dotted path.

    A tied head shares the embedding's table, which ``nnx`` flattens once, under the path it
    meets first (``lm_head.embedding``); it is named ``model.embed_tokens.embedding`` here, as
    a checkpoint of a tied model names it, so that a tied and an untied model differ only by
    ``lm_head.embedding``.
    """
    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    arrays = {".".join(map(str, path)): np.asarray(v[...], np.float32) for path, v in flat}
    if EMBEDDING not in arrays and "lm_head.embedding" in arrays:
        arrays[EMBEDDING] = arrays.pop("lm_head.embedding")
    return arrays


def rope(x_BxTxHxK: jax.Array, theta: float) -> jax.Array:
    """Rotary positions, channel ``i`` paired with ``i + K/2``, tables in float64 NumPy."""
    t, k = x_BxTxHxK.shape[1], x_BxTxHxK.shape[-1]
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, k, 2) / k)[None, :]
    cos, sin = (jnp.asarray(f(angles)[None, :, None, :], jnp.float32) for f in (np.cos, np.sin))
    x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BxTxHxK.dtype)


def _dense(n_in: int, n_out: int, *, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class RefAttention(nnx.Module):
    """Causal self-attention with RoPE: ``o_proj(softmax(q k^T / sqrt(K)) v)``, dense scores."""

    def __init__(self, c: rm.LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        assert c.head_dim is not None and c.num_key_value_heads is not None  # filled when built
        h, g, k, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.heads, self.kv_heads, self.head_dim, self.theta = h, g, k, c.rope_theta
        self.q_proj = _dense(d, h * k, dtype=dtype, rngs=rngs)
        self.k_proj = _dense(d, g * k, dtype=dtype, rngs=rngs)
        self.v_proj = _dense(d, g * k, dtype=dtype, rngs=rngs)
        self.o_proj = _dense(h * k, d, dtype=dtype, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, _ = x_BxTxD.shape
        h, g, k = self.heads, self.kv_heads, self.head_dim
        q = rope(self.q_proj(x_BxTxD).reshape(b, t, h, k), self.theta)
        key = rope(self.k_proj(x_BxTxD).reshape(b, t, g, k), self.theta)
        v = self.v_proj(x_BxTxD).reshape(b, t, g, k)
        # Query head i attends with key/value head i // (h / g): transformers' repeat_kv.
        key, v = jnp.repeat(key, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
        scores = jnp.einsum("bthk,bshk->bhts", q, key, preferred_element_type=jnp.float32)
        scores = jnp.where(np.tril(np.ones((t, t), bool)), scores / np.sqrt(k), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.o_proj(jnp.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, h * k))


class RefMLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, c: rm.LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        d, i = c.hidden_size, c.intermediate_size
        self.gate_proj = _dense(d, i, dtype=dtype, rngs=rngs)
        self.up_proj = _dense(d, i, dtype=dtype, rngs=rngs)
        self.down_proj = _dense(i, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class RefDecoderLayer(nnx.Module):
    """One pre-norm block: ``x += self_attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, c: rm.LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        kw = dict(epsilon=c.rms_norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.input_layernorm = nnx.RMSNorm(c.hidden_size, **kw)
        self.self_attn = RefAttention(c, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(c.hidden_size, **kw)
        self.mlp = RefMLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x_BxTxD = x_BxTxD + self.self_attn(self.input_layernorm(x_BxTxD))
        return x_BxTxD + self.mlp(self.post_attention_layernorm(x_BxTxD))


class RefModel(nnx.Module):
    """The embedding, the decoder layers and the final norm (transformers' ``model``)."""

    def __init__(self, c: rm.LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, **kw)
        layers = [RefDecoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_hidden_layers)]
        self.layers = nnx.List(layers)
        self.norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, **kw)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens_BxT)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class RefLlama(nnx.Module):
    """The trainer's ``LlamaForCausalLM`` written with plain flax layers: the reference.

    Args:
      config: the ``rudax.models.LlamaConfig`` (its ``param_dtype`` is ignored: parameters
        are fp32); ``check_reference_config`` says which fields it implements.
      dtype: compute dtype.
      rngs: draws the initial weights (``load`` replaces them with the rudax model's).

    Returns:
      A module; ``model(tokens_BxT)`` returns ``logits_BxTxV`` in ``dtype``.
    """

    def __init__(self, config: rm.LlamaConfig, *, dtype: Any, rngs: nnx.Rngs):
        check_reference_config(config)
        c = config
        self.model = RefModel(c, dtype=dtype, rngs=rngs)
        self.tied = c.tie_word_embeddings
        if not self.tied:
            kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
            self.lm_head = nnx.Embed(c.vocab_size, c.hidden_size, **kw)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        table = self.model.embed_tokens if self.tied else self.lm_head
        return table.attend(self.model(tokens_BxT))

    @classmethod
    def from_arrays(cls, config: rm.LlamaConfig, arrays: dict, *, dtype: Any) -> RefLlama:
        """A ``RefLlama`` holding ``arrays`` (``flat_params`` of a rudax model), not drawn first."""
        ref = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
        ref.load(arrays)
        return ref

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Sets every parameter from the rudax model's (``flat_params``); names must match."""
        ours = {".".join(map(str, p)): p for p, _ in nnx.to_flat_state(nnx.state(self, nnx.Param))}
        if set(ours) != set(arrays):
            raise ValueError(
                f"parameters differ: missing {sorted(set(ours) - set(arrays))}, "
                f"unexpected {sorted(set(arrays) - set(ours))}"
            )
        for name, path in ours.items():
            node = self
            for key in path[:-1]:
                node = node[key] if isinstance(key, int) else getattr(node, key)
            getattr(node, path[-1]).set_value(jnp.asarray(arrays[name], jnp.float32))


def ref_mean_loss(model: RefLlama, batch_BxT1: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of ``batch_BxT1`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    logits = model(batch_BxT1[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch_BxT1[:, 1:]).mean()


def ref_optimizer(opt: rm.OptimizerSpec) -> optax.GradientTransformation:
    """clip + AdamW in plain optax with the trainer's hyperparameters, schedule and decay mask."""
    peak = opt.learning_rate
    lr = optax.warmup_cosine_decay_schedule(
        0.0, peak, opt.warmup_steps, opt.steps, end_value=peak * opt.min_lr_ratio
    )
    # The trainer's rudax.models.decay_mask: matrices decay (an untied head's table too);
    # norms and the token embedding (also the tied head) do not.
    mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "['embed_tokens']" not in jax.tree_util.keystr(path),
        params,
    )
    adamw = optax.adamw(lr, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=mask)
    return optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), adamw)


def flax_arm(recipe: Recipe, arrays: dict, batch: jax.Array) -> JaxArm:
    """Plain flax+optax: ``RefLlama`` with the rudax model's weights, one donated jitted step."""
    spec = recipe.spec
    ref = RefLlama.from_arrays(spec.config, arrays, dtype=spec.dtype)
    graphdef, params = nnx.split(ref)
    tx = ref_optimizer(recipe.optimizer)
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
