"""rudax.sharding.make_train_steps: one update against a plainly written reference (the
gradient of the window's summed loss over its counted tokens, then the optimizer), on one
device and over meshes of 8 simulated CPU devices; dropout's RNG state; what is averaged and
what summed over devices; the reported gradient norm; donation; one compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


class _Net(nnx.Module):
    def __init__(self, *, dropout: float, rngs: nnx.Rngs):
        self.a = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jax.nn.tanh(self.a(x))))


def _loss(model, batch):
    """A SUM over the rows that count (mask 1), and their count."""
    err = (model(batch["x"])[:, 0] - batch["y"]) ** 2 * batch["mask"]
    return jnp.sum(err), {"tokens": jnp.sum(batch["mask"]).astype(jnp.int32), "sq": jnp.sum(err)}


def _batches(n=2, rows=16):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.standard_normal((rows, 3), np.float32),
            "y": rng.standard_normal(rows).astype(np.float32),
            "mask": (rng.random(rows) < 0.7).astype(np.float32),
        }
        for _ in range(n)
    ]


def _window(steps, tx, state, batches, put=lambda b: b):
    trained, rngs, rest = state
    acc = ro.GradientAccumulator.init(trained, jnp.float32)
    opt_state = tx.init(trained)
    metrics = []
    for b in batches:
        acc, rngs, m = steps.micro(trained, rngs, acc, rest, put(b))
        metrics.append(m)
    trained, opt_state, acc, norm = steps.apply(trained, opt_state, acc)
    return trained, rngs, metrics, norm


def test_one_update_is_the_mean_gradient_of_the_window_then_the_optimizer():
    model = _Net(dropout=0.0, rngs=nnx.Rngs(0))
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    tx = ro.adam(1e-2)
    steps = rs.make_train_steps(graphdef, tx, _loss)
    batches = _batches()
    new, _, metrics, norm = _window(steps, tx, (params, rngs, rest), batches)

    # The reference: the gradient of the window's summed loss over its counted rows.
    def total(p):
        m = nnx.merge(graphdef, p, rngs, rest)
        return sum(_loss(m, b)[0] for b in batches) / sum(b["mask"].sum() for b in batches)

    grads = jax.grad(total)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    want = optax.apply_updates(params, updates)
    for got, ref in zip(jax.tree.leaves(new), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=1e-6)
    assert [int(m["tokens"]) for m in metrics] == [int(b["mask"].sum()) for b in batches]
    np.testing.assert_allclose(metrics[0]["loss_sum"], metrics[0]["sq"])
    # A second window compiles nothing new.
    _window(steps, tx, (new, rngs, rest), batches)
    assert steps.micro._cache_size() == 1 and steps.apply._cache_size() == 1


def test_grad_norm_is_the_clippings_own_before_clipping():
    model = _Net(dropout=0.0, rngs=nnx.Rngs(0))
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    tx = optax.chain(ro.clip_by_global_norm(1e-3), ro.sgd(1.0))
    steps = rs.make_train_steps(graphdef, tx, _loss)
    new, _, _, norm = _window(steps, tx, (params, rngs, rest), _batches(n=1))
    plain = rs.make_train_steps(graphdef, ro.sgd(1.0), _loss)
    _, _, _, want = _window(plain, ro.sgd(1.0), (params, rngs, rest), _batches(n=1))
    assert float(norm) > 1e-3  # clipped: the norm reported is the one before
    np.testing.assert_allclose(norm, want, rtol=1e-6)
    # params - new: float32 values near 1 differ by about 1e-3, so ~1e-7 / 1e-3 of rounding
    step = jax.tree.map(lambda a, b: a - b, params, new)
    np.testing.assert_allclose(optax.tree.norm(step), 1e-3, rtol=1e-3)


def test_dropout_advances_its_counts_on_one_device_and_over_a_mesh():
    # On one device the old fine-tuner's step took nnx.value_and_grad for this: dropout
    # mutates its RNG count inside the differentiated call.
    for mesh in (None, rs.make_mesh({"data": 8})):
        model = _Net(dropout=0.5, rngs=nnx.Rngs(3))
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        counts = lambda r: [np.asarray(v) for v in jax.tree.leaves(r) if v.dtype == jnp.uint32]
        keys = lambda r: [np.asarray(jax.random.key_data(v)) for v in jax.tree.leaves(r)
                          if jnp.issubdtype(v.dtype, jax.dtypes.prng_key)]  # fmt: skip
        before, before_keys = counts(rngs), keys(rngs)
        put = lambda b: b
        if mesh is not None:
            params, rngs, rest = rs.place((params, rngs, rest), mesh)
            put = lambda b, mesh=mesh: rs.put_batch(b, mesh, 16)
        steps = rs.make_train_steps(graphdef, ro.sgd(0.1), _loss, mesh=mesh)
        same = _batches(n=1) * 2  # one batch twice: new masks the second time
        _, rngs, m, _ = _window(steps, ro.sgd(0.1), (params, rngs, rest), same, put)
        pairs = list(zip(before, counts(rngs), strict=True))
        assert pairs and all(a == b + 2 for b, a in pairs), pairs  # two microbatches
        # the keys come back as they went in (over a mesh each device folds in its place)
        assert all(np.array_equal(a, b) for a, b in zip(before_keys, keys(rngs), strict=True))
        assert float(m[0]["loss_sum"]) != float(m[1]["loss_sum"])


def _llama(mesh):
    config = rm.LlamaConfig.tiny(
        64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, param_dtype=jnp.float32
    )
    model = rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if mesh is not None and "fsdp" in mesh.axis_names:
        model = rm.shard(model, rs.ShardingContext(mesh, "fsdp"))
    return model


def _llama_batch(rows=8, t=12):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 64, (rows, t)).astype(np.int32)
    labels = np.where(rng.random((rows, t)) < 0.8, np.roll(tokens, -1, 1), -100).astype(np.int32)
    return {"tokens": tokens, "labels": labels}


def _gathered(tree):
    leaves = []
    for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, rs.ShardedParameter)):
        if isinstance(x, rs.ShardedParameter):
            x = np.asarray(x.local)[: x.size].reshape(x.logical_shape)
        leaves.append(np.asarray(x))
    return leaves


@pytest.mark.parametrize("spec", [{"data": 8}, {"data": 2, "fsdp": 4}, {"fsdp": 8}])
def test_over_a_mesh_the_update_is_the_one_device_update(spec):
    # SGD: the update is linear in the gradient, whose sums run in another order over a mesh
    # (Adam's m / sqrt(v) would magnify that rounding where a gradient is near 0).
    tx = ro.sgd(1.0)
    results = []
    for mesh in (None, rs.make_mesh(spec)):
        graphdef, params, rngs, rest = nnx.split(_llama(mesh), nnx.Param, nnx.RngState, ...)
        put = lambda b: b
        if mesh is not None:
            params, rngs, rest = rs.place((params, rngs, rest), mesh)
            put = lambda b, mesh=mesh: rs.put_batch(b, mesh, 8)
        steps = rs.make_train_steps(graphdef, tx, rm.causal_lm_loss_sum, mesh=mesh)
        batches = [_llama_batch(), _llama_batch(t=12)]
        new, _, metrics, norm = _window(steps, tx, (params, rngs, rest), batches, put)
        results.append((_gathered(new), jax.device_get(metrics), float(norm)))
    (one, m1, n1), (many, m8, n8) = results
    for a, b in zip(one, many, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    for a, b in zip(m1, m8, strict=True):
        assert int(a["tokens"]) == int(b["tokens"])
        np.testing.assert_allclose(a["ce_sum"], b["ce_sum"], rtol=1e-5)
    np.testing.assert_allclose(n1, n8, rtol=1e-5)


def test_mean_metrics_are_averaged_over_devices_and_the_rest_summed():
    mesh = rs.make_mesh({"data": 8})

    def loss(model, batch):
        s = jnp.sum(model(batch["x"]))
        return s, {"tokens": jnp.int32(batch["x"].shape[0]), "rows": jnp.float32(1.0),
                   "aux_loss": jnp.float32(2.0)}  # fmt: skip

    model = _Net(dropout=0.0, rngs=nnx.Rngs(0))
    graphdef, params, rngs, rest = rs.place(nnx.split(model, nnx.Param, nnx.RngState, ...), mesh)
    steps = rs.make_train_steps(graphdef, ro.sgd(0.1), loss, mesh=mesh)
    batch = rs.put_batch({"x": np.ones((16, 3), np.float32)}, mesh, 16)
    m = steps.evaluate(params, rngs, rest, batch)
    assert (int(m["tokens"]), float(m["rows"]), float(m["aux_loss"])) == (16, 8.0, 2.0)


def test_donation_reuses_the_accumulator_and_the_state():
    model = _Net(dropout=0.0, rngs=nnx.Rngs(0))
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    tx = ro.sgd(0.1)
    steps = rs.make_train_steps(graphdef, tx, _loss, donate=True)
    acc = ro.GradientAccumulator.init(params, jnp.float32)
    new_acc, _, _ = steps.micro(params, rngs, acc, rest, _batches(n=1)[0])
    assert all(x.is_deleted() for x in jax.tree.leaves(acc))
    opt_state = tx.init(params)
    steps.apply(params, opt_state, new_acc)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))


def test_evaluate_uses_the_eval_graphdef():
    model = _Net(dropout=0.9, rngs=nnx.Rngs(0))
    model.eval()
    eval_def = nnx.graphdef(model)
    model.train()
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    batch = _batches(n=1)[0]
    steps = rs.make_train_steps(graphdef, ro.sgd(0.1), _loss, eval_graphdef=eval_def)
    model.eval()
    want = _loss(model, batch)[0]
    np.testing.assert_allclose(steps.evaluate(params, rngs, rest, batch)["sq"], want, rtol=1e-6)
