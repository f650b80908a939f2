"""rudax.sharding FSDP (ShardedParameter, ShardingContext) on 8 simulated CPU devices.

The reference is always the same computation on one device: the full parameter, the original
``rudax.layers`` modules, and the sum of the ranks' local losses written as one loss over the
whole batch.
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

N = 8
AX = "fsdp"

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _mesh(kind, n=N):
    if kind == "explicit":
        return jax.make_mesh((n,), (AX,), devices=jax.devices()[:n])
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (AX,))


@pytest.fixture(params=["explicit", "auto"])
def mesh(request):
    return _mesh(request.param)


def _put(mesh, x, spec=None):
    return jax.device_put(x, NamedSharding(mesh, P(AX) if spec is None else spec))


def _per_rank(mesh, fn):
    """A shard_map whose per-rank outputs come back stacked on a new leading axis."""
    return jax.shard_map(
        lambda *a: jax.tree.map(lambda y: y[None], fn(*a)),
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )


# ---------------------------------------------------------------------------- ShardedParameter


@pytest.mark.parametrize("shape", [(5, 3), (16,), (2, 3, 4), (1,), ()])  # () an NF4 offset
def test_gather_returns_the_full_value_and_pads_only_at_the_end(mesh, shape):
    value = jax.random.normal(jax.random.key(0), shape)
    p = rs.ShardedParameter.from_full(value, mesh, AX)
    size = value.size
    k = -(-size // N)
    assert p.local.shape == (N * k,) and p.shard_size == k and p.dtype == np.float32
    flat = np.asarray(p.local)
    np.testing.assert_array_equal(flat[:size], np.asarray(value).reshape(-1))
    np.testing.assert_array_equal(flat[size:], 0.0)
    assert [s.data.shape for s in p.local.addressable_shards] == [(k,)] * N
    out = np.asarray(jax.jit(_per_rank(mesh, lambda q: q.gather()))(p))
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(value), (N, *shape)))
    np.testing.assert_array_equal(p.unshard(), np.asarray(value))


def test_gradient_is_the_single_device_gradient_of_the_summed_local_losses(mesh):
    value = jax.random.normal(jax.random.key(0), (5, 3))
    w = jax.random.normal(jax.random.key(1), (N, 5, 3))  # a different loss on every rank
    p = rs.ShardedParameter.from_full(value, mesh, AX)

    def local_loss(q, w_1x5x3):
        return jnp.sum(jnp.sin(q.gather()) * w_1x5x3[0])[None]

    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(AX), P(AX)), out_specs=P(AX))
    grad = jax.jit(jax.grad(lambda q, w: jnp.sum(sharded(q, w))))(p, _put(mesh, w))
    expected = jax.grad(lambda v: sum(jnp.sum(jnp.sin(v) * w[r]) for r in range(N)))(value)
    assert isinstance(grad, rs.ShardedParameter) and grad.logical_shape == (5, 3)
    # Eight O(1) terms summed in the reduce-scatter's order: atol is their fp32 rounding.
    np.testing.assert_allclose(grad.unshard(), np.asarray(expected), rtol=1e-6, atol=1e-6)
    # The padding (15 logical elements in 8 slices of 2) is never read: exactly zero gradient.
    np.testing.assert_array_equal(np.asarray(grad.local)[15:], 0.0)


def test_from_local_equals_from_full(mesh):
    value = np.arange(15, dtype=np.float32).reshape(5, 3)
    full = rs.ShardedParameter.from_full(value, mesh, AX)
    flat = value.reshape(-1)
    ranges = [full.shard_range(r) for r in range(N)]
    assert ranges[0] == (0, 2) and ranges[7] == (14, 15)
    unpadded = [flat[a:b] for a, b in ranges]
    padded = np.pad(flat, (0, 1)).reshape(N, 2)
    for shards in (unpadded, list(padded), lambda r: padded[r]):
        local = rs.ShardedParameter.from_local(shards, (5, 3), mesh, AX, dtype=np.float32)
        assert local.logical_shape == full.logical_shape and local.num_shards == N
        assert local.local.sharding.is_equivalent_to(full.local.sharding, 1)
        np.testing.assert_array_equal(np.asarray(local.local), np.asarray(full.local))


def test_from_local_of_a_stack_equals_from_full_stacked(mesh):
    value = np.arange(3 * 15, dtype=np.float32).reshape(3, 5, 3)  # 3 layers of (5, 3)
    full = rs.ShardedParameter.from_full(value, mesh, AX, stacked=True)
    flat = value.reshape(3, -1)
    ranges = [full.shard_range(r) for r in range(N)]
    asked = []

    def shards(r):
        asked.append(r)
        a, b = ranges[r]
        return flat[:, a:b]

    local = rs.ShardedParameter.from_local(shards, (5, 3), mesh, AX, dtype=np.float32, layers=3)
    assert local.stacked and local.local.shape == full.local.shape == (3, 16)
    assert local.local.sharding.is_equivalent_to(full.local.sharding, 2)
    np.testing.assert_array_equal(np.asarray(local.local), np.asarray(full.local))
    assert sorted(set(asked)) == list(range(N))
    with pytest.raises(ValueError, match=r"shards\[0\] must have shape \(3, 2\)"):
        rs.ShardedParameter.from_local(
            lambda r: flat[0, :2], (5, 3), mesh, AX, dtype=np.float32, layers=3
        )


def test_compute_dtype_gathers_and_reduce_scatters_in_that_dtype(mesh):
    p = rs.ShardedParameter.from_full(jnp.ones((5, 3), jnp.float32), mesh, AX)

    def local_loss(q):
        return jnp.sum(q.gather(jnp.bfloat16).astype(jnp.float32) ** 2)[None]

    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=P(AX), out_specs=P(AX))
    grad_fn = jax.grad(lambda q: jnp.sum(sharded(q)))
    text = str(jax.make_jaxpr(grad_fn)(p))
    assert "all_gather" in text and "reduce_scatter" in text
    for line in text.splitlines():
        if "all_gather[" in line or "reduce_scatter[" in line:
            assert "bf16" in line.split("=")[0], line
    grad = jax.jit(grad_fn)(p)
    assert grad.dtype == np.float32 and p.dtype == np.float32
    np.testing.assert_array_equal(grad.unshard(), np.full((5, 3), 2.0 * N))
    gathered = jax.jit(_per_rank(mesh, lambda q: q.gather(jnp.bfloat16)))(p)
    assert gathered.dtype == jnp.bfloat16


def test_per_device_bytes_are_one_nth_of_the_full_parameter_and_adam_state(mesh):
    value = jnp.ones((64, 32), jnp.float32)
    p = rs.ShardedParameter.from_full(value, mesh, AX)
    tx = ro.adamw(1e-3)
    state = tx.init(p)

    def device0_bytes(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    replicated = value.nbytes * 3  # parameter, first and second moment
    assert device0_bytes(p) == value.nbytes // N
    # The step count is a replicated scalar; everything else is exactly 1/N.
    assert device0_bytes((p, state)) == replicated // N + 4


def test_bad_input():
    mesh = _mesh("auto")
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        rs.ShardedParameter.from_full(jnp.ones(3), "mesh", AX)
    with pytest.raises(ValueError, match="axis_name must be one of"):
        rs.ShardedParameter.from_full(jnp.ones(3), mesh, "data")
    p = rs.ShardedParameter.from_full(jnp.ones((5, 3)), mesh, AX)
    with pytest.raises(ValueError, match="not bound"):
        p.gather()
    with pytest.raises(ValueError, match="has size 4"):  # a parameter split 8 ways, 4 ranks
        small = _mesh("auto", 4)
        f = jax.shard_map(lambda q: q.gather()[None], mesh=small, in_specs=P(), out_specs=P(AX))
        f(rs.ShardedParameter(jnp.ones(2), (5, 3), AX, N))
    with pytest.raises(
        ValueError, match=r"shards\[7\] must have shape \(1,\) \(or \(2,\) padded\)"
    ):
        shards = [np.zeros(2, np.float32)] * 7 + [np.zeros(3, np.float32)]
        rs.ShardedParameter.from_local(shards, (5, 3), mesh, dtype=np.float32)
    with pytest.raises(ValueError, match=r"shards\[7\]: its padding .* must be zero"):
        rs.ShardedParameter.from_local([np.ones(2, np.float32)] * N, (5, 3), mesh, dtype=np.float32)
    with pytest.raises(TypeError, match=r"shards\[0\] has dtype float64"):
        rs.ShardedParameter.from_local([np.ones(2)] * N, (5, 3), mesh, dtype=np.float32)
    with pytest.raises(ValueError, match="rank must be in"):
        p.shard_range(8)


# ---------------------------------------------------------------------------- ShardingContext


def _train_step(tx, loss_fn):
    """One jitted optimizer step on loss_fn(params, *batch); returns (params, state, loss)."""

    @jax.jit
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _logical(model):
    """{(module index, *layer path): logical value} of a list of ShardedModules."""
    return {
        (i, *path): var.get_value().unshard()
        for i, m in enumerate(model)
        for path, var in zip(m.paths, m.variables, strict=True)
    }


def _reference(model):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_adamw_on_sharded_mlp_matches_one_device():
    mesh = _mesh("auto")  # the transformer tests below train on both mesh kinds
    rngs = nnx.Rngs(0)
    layers = [
        rl.Linear(4, 6, use_bias=True, rngs=rngs),
        rl.RMSNorm(6, impl="xla"),
        rl.GatedMLP(6, 10, impl="xla", rngs=rngs),
    ]
    ref = nnx.List(layers)
    ctx = rs.ShardingContext(mesh, AX)
    model = nnx.List([ctx.linear(layers[0]), ctx.rms_norm(layers[1]), ctx.gated_mlp(layers[2])])
    x = jax.random.normal(jax.random.key(1), (2 * N, 4))
    y = jax.random.normal(jax.random.key(2), (2 * N, 6))
    tx = ro.adamw(1e-2, weight_decay=0.1)

    total = y.size

    def loss_sum(net, x, y):
        for layer in net:
            x = layer(x)
        return jnp.sum((x - y) ** 2) / total  # the global mean: every rank divides by the total

    ref_graph, ref_params = nnx.split(ref)
    ref_step = _train_step(tx, lambda p, x, y: loss_sum(nnx.merge(ref_graph, p), x, y))
    graph, params = nnx.split(model)
    local = jax.shard_map(
        lambda p, x, y: loss_sum(nnx.merge(graph, p), x, y)[None],
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )
    step = _train_step(tx, lambda p, x, y: jnp.sum(local(p, x, y)))
    # The step count comes from tx.init on one device; replicated on the mesh, as the step
    # returns it, the second step reuses the first compilation.
    state = jax.tree.map(
        lambda v: v if isinstance(v.sharding, NamedSharding) else _put(mesh, v, P()),
        tx.init(params),
    )
    ref_state = tx.init(ref_params)
    xs, ys = _put(mesh, x), _put(mesh, y)
    for _ in range(3):
        ref_params, ref_state, ref_loss = ref_step(ref_params, ref_state, x, y)
        params, state, loss = step(params, state, xs, ys)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert step._cache_size() == 1
    nnx.update(ref, ref_params)
    nnx.update(model, params)
    expected, got = _reference(ref), _logical(model)
    assert got.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _grads_match(mesh, ref, model, ids_or_x, wrt=nnx.Param):
    """Gradients wrt ``wrt`` of sum(out * w): one device, then through the sharded model."""
    out_ref = ref(ids_or_x)
    w = jax.random.normal(jax.random.key(3), out_ref.shape)
    ref_graph, ref_params, ref_rest = nnx.split(ref, wrt, ...)
    ref_grads = jax.grad(lambda p: jnp.sum(nnx.merge(ref_graph, p, ref_rest)(ids_or_x) * w))(
        ref_params
    )
    graph, params, rest = nnx.split(model, wrt, ...)
    local = jax.shard_map(
        lambda p, r, a, w: jnp.sum(nnx.merge(graph, p, r)(a) * w)[None],
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )
    grads = jax.jit(
        jax.grad(lambda p: jnp.sum(local(p, rest, _put(mesh, ids_or_x), _put(mesh, w))))
    )(params)
    return ref_grads, grads


def test_tied_embedding_is_one_shard_with_both_uses_in_its_gradient(mesh):
    embed = rl.Embedding(11, 4, rngs=nnx.Rngs(0))
    ctx = rs.ShardingContext(mesh, AX)
    sharded_embed = ctx.embedding(embed)
    head = ctx.tied_projection(embed)
    assert head.variables[0] is sharded_embed.variables[0]  # the same object
    model = nnx.Sequential(sharded_embed, head)
    assert len(jax.tree.leaves(nnx.state(model))) == 1  # one leaf
    ref = nnx.Sequential(embed, rl.TiedProjection(embed))
    ids = jnp.arange(2 * N) % 11
    ref_grads, grads = _grads_match(mesh, ref, model, ids)
    (g,) = jax.tree.leaves(grads)
    (g_ref,) = jax.tree.leaves(ref_grads)
    np.testing.assert_allclose(np.asarray(g)[: g_ref.size].reshape(11, 4), g_ref, rtol=1e-5)
    # The table changed under it: a clear error, not a second shard.
    embed.embedding.set_value(embed.embedding.get_value().astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"tied parameter reused.*float32.*bfloat16"):
        ctx.tied_projection(embed)


def test_lora_keeps_the_base_frozen_and_sharded():
    mesh = _mesh("auto")  # the LoRA transformer test uses the explicit mesh
    base = rl.Linear(4, 6, rngs=nnx.Rngs(0))
    lora = rl.LoRALinear(base, 2, alpha=4.0, rngs=nnx.Rngs(1))
    nnx.update(lora, {"lora_b": jax.random.normal(jax.random.key(5), (2, 6))})
    sharded = rs.ShardingContext(mesh, AX).lora(lora)
    types = [type(v) for v in sharded.variables]
    assert types == [type(v) for _, v in nnx.to_flat_state(nnx.state(lora))]
    assert types.count(rl.Frozen) == 2  # the base's kernel and bias
    assert len(jax.tree.leaves(nnx.state(sharded, nnx.Param))) == 2  # lora_a, lora_b
    x = jax.random.normal(jax.random.key(2), (N, 4))
    ref_grads, grads = _grads_match(mesh, lora, sharded, x)
    flat_ref = {p: v.get_value() for p, v in nnx.to_flat_state(ref_grads)}
    for (_, i), var in nnx.to_flat_state(grads):
        path = sharded.paths[i]
        expected = np.asarray(flat_ref[path])
        np.testing.assert_allclose(var.get_value().unshard(), expected, rtol=1e-5, atol=1e-7)


def test_context_bad_input():
    mesh = _mesh("auto")
    ctx = rs.ShardingContext(mesh, AX)
    with pytest.raises(ValueError, match="axis_name must be one of"):
        rs.ShardingContext(mesh, "data")
    with pytest.raises(TypeError, match=r"l must be a rudax\.layers\.Linear"):
        ctx.linear(rl.RMSNorm(3))
    with pytest.raises(TypeError, match="compute_dtype"):
        ctx.rms_norm(rl.RMSNorm(3), compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"\.stats.*BatchStat"):
        ctx.module(nnx.Dict(stats=nnx.BatchStat(jnp.ones(3))))


# ---------------------------------------------------------------------- the tiny transformer

V, D, H, T = 11, 8, 2, 4


def _transformer(*, lora: bool):
    rngs = nnx.Rngs(0)
    linear = lambda: rl.Linear(D, D, use_bias=False, rngs=rngs)
    mods = dict(
        embed=rl.Embedding(V, D, rngs=rngs),
        norm1=rl.RMSNorm(D, impl="xla"),
        q=linear(),
        k=linear(),
        v=linear(),
        o=linear(),
        norm2=rl.RMSNorm(D, impl="xla"),
        mlp=rl.GatedMLP(D, 2 * D, impl="xla", rngs=rngs),
        norm3=rl.RMSNorm(D, impl="xla"),
    )
    if lora:  # adapters on q and v over a frozen base; zero-initialized B made nonzero
        for name in ("q", "v"):
            mods[name] = rl.LoRALinear(mods[name], 2, alpha=4.0, rngs=rngs)
            b = mods[name].lora_b
            b.set_value(0.1 * jax.random.normal(jax.random.key(len(name)), b.get_value().shape))
    mods["head"] = rl.TiedProjection(mods["embed"])
    return mods


def _shard(ctx, mods):
    convert = dict(
        embed=ctx.embedding,
        norm1=ctx.rms_norm,
        norm2=ctx.rms_norm,
        norm3=ctx.rms_norm,
        mlp=ctx.gated_mlp,
        head=lambda h: ctx.tied_projection(mods["embed"]),
    )
    lin = lambda m: ctx.lora(m) if isinstance(m, rl.LoRALinear) else ctx.linear(m)
    return {name: convert.get(name, lin)(m) for name, m in mods.items()}


def _forward(m, ids_BxT):
    x = m["embed"](ids_BxT)
    h = m["norm1"](x)
    split = lambda y: y.reshape(*y.shape[:-1], H, D // H)
    q, k, v = split(m["q"](h)), split(m["k"](h)), split(m["v"](h))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / float(np.sqrt(D // H))
    causal = jnp.tril(jnp.ones((T, T), bool))
    scores = jnp.where(causal, scores, jnp.array(-jnp.inf, scores.dtype))
    att = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    x = x + m["o"](att.reshape(*att.shape[:2], D))
    x = x + m["mlp"](m["norm2"](x))
    return m["head"](m["norm3"](x))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiny_transformer_trains_like_one_device(lora):
    mesh = _mesh("explicit" if lora else "auto")
    ref = _transformer(lora=lora)
    sharded = _shard(rs.ShardingContext(mesh, AX), ref)
    ref_model, model = nnx.Dict(ref), nnx.Dict(sharded)
    ids = jax.random.randint(jax.random.key(7), (N, T + 1), 0, V)
    total = N * T
    tx = ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))

    def loss_sum(m, ids_BxT1):
        logits = _forward(m, ids_BxT1[:, :-1])
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        target = jnp.take_along_axis(logp, ids_BxT1[:, 1:, None], axis=-1)
        return -jnp.sum(target) / total

    ref_graph, ref_params, ref_frozen = nnx.split(ref_model, nnx.Param, ...)
    ref_step = _train_step(tx, lambda p, f, ids: loss_sum(nnx.merge(ref_graph, p, f), ids))
    graph, params, frozen = nnx.split(model, nnx.Param, ...)
    assert len(jax.tree.leaves(params)) == len(jax.tree.leaves(ref_params))
    local = jax.shard_map(
        lambda p, f, ids: loss_sum(nnx.merge(graph, p, f), ids)[None],
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )
    step = _train_step(tx, lambda p, f, ids: jnp.sum(local(p, f, ids)))
    ref_state, state = tx.init(ref_params), tx.init(params)
    ids_placed = _put(mesh, ids)
    for _ in range(3):
        ref_params, ref_state, ref_loss = ref_step(ref_params, ref_state, ref_frozen, ids)
        params, state, loss = step(params, state, frozen, ids_placed)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    nnx.update(ref_model, ref_params)
    nnx.update(model, params)
    expected = _reference(ref_model)
    got = {
        (name, *path): var.get_value().unshard()
        for name, m in sharded.items()
        for path, var in zip(m.paths, m.variables, strict=True)
    }
    assert set(expected) <= set(got)
    for path, want in expected.items():
        np.testing.assert_allclose(got[path], want, rtol=1e-5, atol=1e-6, err_msg=str(path))
    if lora:  # the frozen base did not move
        base = _transformer(lora=True)["q"].base.kernel.get_value()
        np.testing.assert_array_equal(got[("q", "base", "kernel")], np.asarray(base))


def test_module_compute_dtype_keeps_storage_and_the_activation_dtype(mesh):
    lin = rl.Linear(4, 6, rngs=nnx.Rngs(0))
    sharded = rs.ShardingContext(mesh, AX).linear(lin, compute_dtype=jnp.bfloat16)
    assert sharded.variables[1].get_value().dtype == np.float32  # storage unchanged
    x = jax.random.normal(jax.random.key(1), (N, 4))
    graph, params = nnx.split(sharded)
    f = jax.shard_map(
        lambda p, x: nnx.merge(graph, p)(x), mesh=mesh, in_specs=P(AX), out_specs=P(AX)
    )
    y = jax.jit(f)(params, _put(mesh, x))
    assert y.dtype == np.float32  # Linear(dtype=None) computes in the input's dtype
    rounded = lin.kernel.get_value().astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ rounded), rtol=1e-6)
    assert not np.allclose(np.asarray(y), np.asarray(x @ lin.kernel.get_value()), rtol=1e-6)


# ------------------------------------------------------------- fp32 masters of bf16 shards


def _bf16(layer):
    for _, var in nnx.to_flat_state(nnx.state(layer)):
        var.set_value(var.get_value().astype(jnp.bfloat16))
    return layer


def test_fp32_master_on_bf16_shards_matches_one_device_and_stores_rounded_masters():
    mesh = _mesh("auto")
    rngs = nnx.Rngs(0)
    layers = [
        _bf16(rl.Linear(4, 6, use_bias=True, rngs=rngs)),
        _bf16(rl.RMSNorm(6, impl="xla")),
        _bf16(rl.GatedMLP(6, 10, impl="xla", rngs=rngs)),
    ]
    ref = nnx.List(layers)
    ctx = rs.ShardingContext(mesh, AX)
    # bf16 storage, fp32 gather: the gradient is reduce-scattered in fp32 and rounded to bf16
    # once, as on one device. (A bf16 gather rounds every rank's partial gradient first; that
    # differs from one device by bf16 roundings, not by anything fp32_master does.)
    f32 = dict(compute_dtype=jnp.float32)
    model = nnx.List(
        [
            ctx.linear(layers[0], **f32),
            ctx.rms_norm(layers[1], **f32),
            ctx.gated_mlp(layers[2], **f32),
        ]
    )
    x = jax.random.normal(jax.random.key(1), (2 * N, 4))
    y = jax.random.normal(jax.random.key(2), (2 * N, 6))
    tx = ro.fp32_master(ro.adamw(1e-2, weight_decay=0.1))
    total = y.size

    def loss_sum(net, x, y):
        for layer in net:  # fp32 activations: each layer casts its parameters to them
            x = layer(x)
        return jnp.sum((x - y) ** 2) / total  # the global mean: every rank divides by the total

    ref_graph, ref_params = nnx.split(ref)
    ref_step = _train_step(tx, lambda p, x, y: loss_sum(nnx.merge(ref_graph, p), x, y))
    graph, params = nnx.split(model)
    local = jax.shard_map(
        lambda p, x, y: loss_sum(nnx.merge(graph, p), x, y)[None],
        mesh=mesh,
        in_specs=P(AX),
        out_specs=P(AX),
    )
    step = _train_step(tx, lambda p, x, y: jnp.sum(local(p, x, y)))
    ref_state, state = tx.init(ref_params), tx.init(params)
    xs, ys = _put(mesh, x), _put(mesh, y)
    is_sharded = lambda v: isinstance(v, rs.ShardedParameter)
    for _ in range(3):
        ref_params, ref_state, ref_loss = ref_step(ref_params, ref_state, x, y)
        params, state, loss = step(params, state, xs, ys)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        # Every stored bf16 shard (padding included) is its fp32 master rounded, bit for bit.
        stored = jax.tree.leaves(params, is_leaf=is_sharded)
        masters = jax.tree.leaves(state.master, is_leaf=is_sharded)
        assert len(stored) == len(masters) == 6
        for p, m in zip(stored, masters, strict=True):
            assert p.dtype == jnp.bfloat16 and m.dtype == np.float32
            assert m.local.sharding.is_equivalent_to(p.local.sharding, 1)
            want = np.asarray(m.local).astype(jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(p.local).view(np.uint16), want.view(np.uint16))
    nnx.update(ref, ref_params)
    nnx.update(model, params)
    expected, got = _reference(ref), _logical(model)
    assert got.keys() == expected.keys()
    for path in expected:
        assert got[path].dtype == expected[path].dtype == jnp.bfloat16
    got_masters = {
        (i, *model[i].paths[j]): v.get_value().unshard()
        for (i, _, j), v in nnx.to_flat_state(state.master)
    }
    want_masters = _reference(ref_state.master)
    assert got_masters.keys() == want_masters.keys() == expected.keys()
    for path, want in want_masters.items():
        np.testing.assert_allclose(got_masters[path], want, rtol=1e-5, atol=1e-6, err_msg=path)


# ------------------------------------------------------------------------------- stacked


def test_a_stack_is_split_layer_by_layer_and_gathered_one_layer_at_a_time():
    """from_full(stacked=True): each of L parameters padded and split on its own, stored
    (L, N*k); a scan over the leading axis gathers layer i's value, as a parameter of its
    own; the stack itself is never gathered whole."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    value = jnp.arange(3 * 5 * 3, dtype=jnp.float32).reshape(3, 5, 3)  # 15 -> k = 2
    p = rs.ShardedParameter.from_full(value, mesh, "fsdp", stacked=True)
    assert (p.stacked, p.logical_shape, p.local.shape) == (True, (5, 3), (3, N * 2))
    assert p.local.sharding.spec == P(None, "fsdp")
    np.testing.assert_array_equal(p.unshard(), np.asarray(value))
    np.testing.assert_array_equal(np.asarray(p.local)[1, 15:], 0.0)  # each row padded alone
    # the storage's spec for shard_map and for placing its optimizer state
    specs = rs.shard_specs({"p": p, "n": jnp.zeros(())})  # the tree's structure, kept
    assert (specs["p"].local, specs["n"]) == (P(None, "fsdp"), P())

    def per_layer(p):
        def body(carry, layer):  # layer: one ShardedParameter of local (k,)
            return carry, layer.gather()

        return jax.lax.scan(body, 0.0, p)[1][None]

    got = jax.shard_map(per_layer, mesh=mesh, in_specs=(rs.shard_specs(p),), out_specs=P("fsdp"))(p)
    for rank in range(N):  # every rank gathers every layer whole
        np.testing.assert_array_equal(np.asarray(got[rank]), np.asarray(value))
    whole = jax.shard_map(
        lambda p: p.gather()[None], mesh=mesh, in_specs=(rs.shard_specs(p),), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"a stack of 3 parameters .* gathered one at a time"):
        whole(p)


def test_shard_specs_refuses_what_is_not_sharded_storage():
    with pytest.raises(ValueError, match=r"a leaf of shape \(2, 3, 4\) is neither"):
        rs.shard_specs({"w": jnp.zeros((2, 3, 4))})
