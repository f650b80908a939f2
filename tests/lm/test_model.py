"""examples/lm's GPT (model.py, moe.py) against references written here.

Every comparison runs a tiny fp32 model; the references are NumPy (cross entropy, the MoE
forward), a per-token jnp loop (the MoE gradient) and one device (FSDP). The attention layer
and RoPE (rudax.layers) are checked against NumPy in tests/layers/test_attention.py and
test_rope.py; the Llama layouts (GQA, separate q/k/v, untied head, biases, Llama 3 RoPE)
against transformers itself in tests/lm/test_hf.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.optim as ro
import rudax.sharding as rs
from examples.lm.model import GPT, GPTConfig, flops_per_token, loss_sum, shard
from examples.lm.step import decay_mask

F32 = dict(param_dtype=jnp.float32, dtype=jnp.float32)
# One block: every test of a whole model compiles it, and compiling dominates these tests.
TINY = dict(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32)


def _config(**overrides):
    return GPTConfig(**{**TINY, **F32, **overrides})


def _batch(b, t, *, seed=0):
    return np.random.default_rng(seed).integers(0, 32, size=(b, t), dtype=np.int32)


def _normal(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# One compilation per model structure and input shape: op-by-op (eager) nnx calls compile every
# op separately, which costs more than the tests themselves.
_forward = nnx.jit(lambda model, *args: model(*args))


# ------------------------------------------------------------------------- model and config


def test_shapes_dtypes_tied_table_and_causality():
    model = GPT(GPTConfig(**{**TINY, "n_layers": 2}), rngs=nnx.Rngs(0))  # bf16 storage, compute
    tokens = _batch(3, 8)
    logits, aux = _forward(model, tokens)
    assert logits.shape == (3, 8, 32) and logits.dtype == jnp.bfloat16
    assert aux.shape == () and aux.dtype == jnp.float32 and float(aux) == 0.0
    assert model.head.embedding is model.embed.embedding
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {np.dtype(jnp.bfloat16)}
    # Per block: two norm scales, qkv, out, gate, up, down; plus the table and the final norm.
    assert len(leaves) == 2 * 7 + 2
    # Changing token t changes no logit before t (masked scores give exact zeros), some after.
    t, changed = 5, tokens.copy()
    changed[:, t] = (changed[:, t] + 1) % 32
    after, _ = _forward(model, changed)
    np.testing.assert_array_equal(np.asarray(after)[:, :t], np.asarray(logits)[:, :t])
    assert not np.array_equal(np.asarray(after)[:, t:], np.asarray(logits)[:, t:])


def _np_softmax(s, axis=-1):
    e = np.exp(s - s.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def test_loss_sum_is_numpy_cross_entropy_summed():
    config = _config(num_experts=4, top_k=2, moe_aux_weight=0.5)
    model = GPT(config, rngs=nnx.Rngs(0))
    batch = np.asarray(_batch(3, 7))
    both = nnx.jit(lambda m, b: (*m(b[:, :-1]), loss_sum(m, b)))
    logits, aux, (loss, metrics) = both(model, batch)
    assert logits.shape == (3, 6, 32) and aux.shape == () and aux.dtype == jnp.float32
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch[:, 1:, None], -1).sum()
    assert int(metrics["tokens"]) == 18 and metrics["tokens"].dtype == jnp.int32
    np.testing.assert_allclose(float(metrics["ce_sum"]), ce, rtol=1e-5)
    # At init the router is near uniform, P_e ~ 1/E, so E sum_e f_e P_e ~ sum_e f_e = 1.
    assert float(metrics["aux_loss"]) == float(aux) and 0.9 < float(aux) < 1.1
    np.testing.assert_allclose(float(loss), ce + 0.5 * 18 * float(aux), rtol=1e-5)


def test_token_weighted_accumulation_gives_the_mean_loss_gradient():
    graph, params = nnx.split(GPT(_config(), rngs=nnx.Rngs(0)))
    grad = jax.grad(lambda p, b: loss_sum(nnx.merge(graph, p), b), has_aux=True)

    @jax.jit
    def accumulated_and_direct(params, whole):
        acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
        for part in (whole[:2], whole[2:]):  # 16 and 24 tokens
            g, metrics = grad(params, part)
            acc = acc.add(g, weight=metrics["tokens"])
        mean_loss = lambda p: loss_sum(nnx.merge(graph, p), whole)[0] / 40.0
        return acc.pop(normalize=True)[0], jax.grad(mean_loss)(params)

    got, want = accumulated_and_direct(params, _batch(5, 9))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_loss_falls_over_twenty_adamw_steps_on_a_repeated_batch():
    model = GPT(GPTConfig(**TINY), rngs=nnx.Rngs(0))  # bf16 storage and compute
    graph, params = nnx.split(model)
    tx = ro.fp32_master(ro.adamw(1e-2))

    @jax.jit
    def step(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: loss_sum(nnx.merge(graph, p), batch), has_aux=True
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        mean = loss / metrics["tokens"].astype(jnp.float32)
        return optax.apply_updates(params, updates), opt_state, mean

    opt_state, batch, losses = tx.init(params), _batch(4, 9), []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert step._cache_size() == 1
    assert losses[-1] < 0.5 * losses[0], losses


# Every Llama-checkpoint field at once: GQA, separate q/k/v with biases, an untied head.
LLAMA = dict(n_heads=4, n_kv_heads=2, fused_qkv=False, qkv_bias=True, tie_embeddings=False)


def test_untied_head_has_its_own_table_in_the_fused_and_plain_loss():
    config = _config(**LLAMA)
    model = GPT(config, rngs=nnx.Rngs(0))
    assert model.head.embedding is not model.embed.embedding
    assert model.head.embedding.shape == (32, 16)  # [V, d]: HF's lm_head.weight layout
    tied = GPT(_config(**{**LLAMA, "tie_embeddings": True}), rngs=nnx.Rngs(0))
    n = lambda m: len(jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n(model) == n(tied) + 1
    # The fused chunked loss reads the head's own table: value and gradients equal the
    # plain full-logits loss (loss_chunk=None) of the same weights.
    graph, params = nnx.split(model)
    plain_graph = nnx.graphdef(GPT(_config(**LLAMA, loss_chunk=None), rngs=nnx.Rngs(0)))
    batch = _batch(2, 9)
    grads = jax.jit(
        lambda p, g: jax.value_and_grad(lambda p: loss_sum(nnx.merge(g, p), batch)[0])(p),
        static_argnums=1,
    )
    (fused_loss, fused), (plain_loss, plain) = grads(params, graph), grads(params, plain_graph)
    np.testing.assert_allclose(float(fused_loss), float(plain_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # The head's table gets the logits' gradient, the embedding only the lookup's.
    head_grad, embed_grad = fused["head"]["embedding"][...], fused["embed"]["embedding"][...]
    assert np.abs(np.asarray(head_grad)).min(axis=1).max() > 0  # every row: softmax mass
    untouched = sorted(set(range(32)) - set(batch[:, :-1].ravel().tolist()))
    np.testing.assert_array_equal(np.asarray(embed_grad)[untouched], 0.0)


def test_decay_mask_decays_the_new_matrices_not_the_biases():
    model = GPT(_config(**LLAMA), rngs=nnx.Rngs(0))
    model.blocks[0].attn.v = rl.LoRALinear(model.blocks[0].attn.v, 2, alpha=4.0, rngs=nnx.Rngs(1))
    mask = {
        path: v.get_value()
        for path, v in nnx.to_flat_state(decay_mask(nnx.state(model, nnx.Param)))
    }
    attn = ("blocks", 0, "attn")
    assert mask[("head", "embedding")] is True  # an untied head is a matrix like the others
    assert mask[("embed", "embedding")] is False
    assert mask[(*attn, "q", "kernel")] is True and mask[(*attn, "k", "kernel")] is True
    assert mask[(*attn, "q", "bias")] is False and mask[(*attn, "k", "bias")] is False
    assert mask[(*attn, "v", "lora_a")] is True and mask[(*attn, "v", "lora_b")] is True
    assert (*attn, "v", "base", "kernel") not in mask  # frozen: not a parameter


# -------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(num_experts=4, top_k=2), LLAMA, {**LLAMA, "n_kv_heads": 1, "fused_qkv": True}],
    ids=["dense", "moe", "llama", "mqa-fused"],
)
def test_flops_per_token_counts_the_matmul_parameters_a_token_uses(overrides):
    config = _config(**overrides)
    model = GPT(config, rngs=nnx.Rngs(0))
    used = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, size = path[-1], var.get_value().size
        if name in ("w_gate", "w_up", "w_down"):  # E experts stored, top_k used
            used += size // config.num_experts * config.top_k
        elif name == "kernel":  # qkv (or q, k, v), out, the dense MLP, the router
            used += size
    head = config.vocab_size * config.d_model  # tied or not: one matmul with a [V, d] table
    attention = config.n_layers * config.seq_len * config.d_model
    assert flops_per_token(config) == 6 * used + 6 * attention + 6 * head


# --------------------------------------------------------------------------------- FSDP

N = 8


@pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")
@pytest.mark.parametrize(
    ("overrides", "mesh_kind"),
    [({}, "auto"), (dict(num_experts=4, top_k=2), "explicit"), ({**LLAMA, "lora": True}, "auto")],
    ids=["dense-auto", "moe-explicit", "llama-lora-auto"],
)
def test_sharded_loss_and_gradients_equal_one_device(overrides, mesh_kind):
    devices = jax.devices()[:N]
    if mesh_kind == "explicit":
        mesh = jax.make_mesh((N,), ("fsdp",), devices=devices)
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    lora = overrides.pop("lora", False)
    model = GPT(_config(**overrides), rngs=nnx.Rngs(0))
    if lora:  # adapters on q and v, as apply_lora puts them; B non-zero, so they matter
        for name in ("q", "v"):
            layer = rl.LoRALinear(
                getattr(model.blocks[0].attn, name), 2, alpha=4.0, rngs=nnx.Rngs(1)
            )
            layer.lora_b.set_value(jnp.asarray(_normal(*layer.lora_b.shape, seed=7)))
            setattr(model.blocks[0].attn, name, layer)
    sharded = shard(model, rs.ShardingContext(mesh, "fsdp"))
    assert model.blocks[0].mlp is not sharded.blocks[0].mlp  # model itself is unchanged
    batch = _batch(N, 9)

    graph, params = nnx.split(sharded)
    local = lambda p, b: jax.lax.psum(loss_sum(nnx.merge(graph, p), b)[0], "fsdp")
    total = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
    placed = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    loss, grads = jax.jit(jax.value_and_grad(total))(params, placed)

    # One device: the same sum of per-rank losses (each rank's MoE balancing term is of its
    # own tokens; for the dense model the sum is the loss of the whole batch).
    ref_graph, ref_params = nnx.split(model)
    per_rank = lambda p, b_T1: loss_sum(nnx.merge(ref_graph, p), b_T1[None])[0]
    ref_total = lambda p: jnp.sum(jax.vmap(per_rank, in_axes=(None, 0))(p, batch))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref_total))(ref_params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

    nnx.update(sharded, grads)
    got = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                got[(*prefix, *path)] = var.get_value().unshard()
    want = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(ref_grads)}
    assert set(want) <= set(got) and len(jax.tree.leaves(params)) == len(want)
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=str(path))


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(vocab_size=0), ValueError, "vocab_size must be a positive int, got vocab_size=0"),
        (dict(seq_len=2.0), TypeError, "seq_len must be an int, got seq_len=2.0"),
        (dict(n_layers=True), TypeError, "n_layers must be an int"),
        (dict(d_model=18, n_heads=4), ValueError, "d_model must be a multiple of n_heads=4"),
        (dict(d_model=12, n_heads=4), ValueError, "must be even for RoPE.*head_dim=3"),
        (dict(mlp_hidden=0), ValueError, "mlp_hidden must be a positive int, got mlp_hidden=0"),
        (dict(rope_theta=0.0), ValueError, "rope_theta must be a finite number > 0"),
        (dict(norm_eps=-1e-6), ValueError, "norm_eps must be a finite number > 0"),
        (dict(param_dtype=jnp.int32), TypeError, "param_dtype must be bfloat16, float16"),
        (dict(dtype="float64"), TypeError, "dtype must be bfloat16, float16 or float32"),
        (dict(num_experts=-1), ValueError, "num_experts must be >= 0"),
        (dict(num_experts=4, top_k=0), ValueError, "top_k must be a positive int, got top_k=0"),
        (dict(num_experts=4, top_k=5), ValueError, "top_k must be <= num_experts=4, got top_k=5"),
        (dict(moe_aux_weight=-0.1), ValueError, "moe_aux_weight must be a finite number >= 0"),
        (dict(moe_impl="sparse"), ValueError, "moe_impl must be one of .*got moe_impl='sparse'"),
        (dict(n_kv_heads=3), ValueError, "n_kv_heads must divide n_heads=2, got n_kv_heads=3"),
        (dict(n_kv_heads=0), ValueError, "n_kv_heads must be a positive int"),
        (dict(tie_embeddings="no"), TypeError, "tie_embeddings must be a bool"),
        (dict(fused_qkv=1), TypeError, "fused_qkv must be a bool, got fused_qkv=1"),
        (dict(qkv_bias=None), TypeError, "qkv_bias must be a bool"),
        (dict(rope_scaling={"factor": 8.0}), TypeError, "rope_scaling must be None or a Llama3"),
    ],
)
def test_bad_config_names_the_field_and_value(overrides, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**{**TINY, **overrides})


def test_bad_input():
    config = _config()
    assert GPTConfig(d_model=256).mlp_hidden == 704  # 8/3 * 256 = 682.7, rounded up to 64s
    assert GPTConfig(param_dtype="bfloat16") == GPTConfig(param_dtype=jnp.bfloat16)
    model = GPT(config, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="integer token ids"):
        model(jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"1 <= time <= seq_len=8, got tokens_BxT.shape=\(2, 9\)"):
        model(jnp.zeros((2, 9), jnp.int32))
    with pytest.raises(ValueError, match=r"batch_BxT1.shape=\(2, 1\)"):
        loss_sum(model, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        flops_per_token(TINY)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    with pytest.raises(TypeError, match="model must be a GPT"):
        shard(nnx.List([]), rs.ShardingContext(mesh))
    with pytest.raises(TypeError, match=r"ctx must be a rudax\.sharding\.ShardingContext"):
        shard(model, mesh)
