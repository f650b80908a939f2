"""rudax.sharding.fsdp_muon (issue 30) on 8 simulated devices against one-device rudax.optim.muon.

The reference is ``ro.muon`` on the whole parameters, the same gradients and hyperparameters:
``fsdp_muon`` must give, step after step, the parameters it gives, unsharded. The matrices are
sized so that no shard count divides them (padded shards), and there are more and fewer of a
shape than devices (full rounds and leftovers); layers are stored plain and stacked.

Tolerance (fp32 Newton-Schulz): rtol = atol = 1e-5 on parameters of order 1 after 3 steps of
lr 0.02. The two programs compute the same arithmetic but XLA rounds it in different orders
(a batch of matrices in one matmul against one matmul per leaf, fused reductions): the
momentum agrees to a few fp32 ulps, and Newton-Schulz's quintic (slope up to a = 3.44 at each
of its 5 iterations) can grow that by a few hundred, to ~1e-5 relative on the update and so
~1e-7 on the parameters (1.2e-7 seen here). A matrix orthogonalized on the wrong shards, or
with its padding read as values, moves a parameter by about lr = 2e-2.
"""

import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.optim as ro
import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss_sum, shard

N = 8
AX = "fsdp"
SP = rs.ShardedParameter
TOL = dict(rtol=1e-5, atol=1e-5)
LR = 0.02

pytestmark = pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")


def _mesh(kind="auto"):
    devices = jax.devices()[:N]
    if kind == "explicit":
        return jax.make_mesh((N,), (AX,), devices=devices)
    if kind == "data_x_fsdp":  # 2 x 4: the fsdp axis has 4 devices, each slice of data the same
        return jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", AX))
    return jax.sharding.Mesh(np.array(devices), (AX,))


def _is_sp(x):
    return isinstance(x, SP)


def _llama(layers, *, scan=False):
    # hidden 18, 3 heads of 6, one kv head, MLP 30: q/o (18, 18) = 324, k/v (18, 6) = 108,
    # gate/up (18, 30) and down (30, 18) = 540 elements, none a multiple of 8 (padded shards);
    # 7 matrices a layer: 2 + 2 + 2 + 1 of the four shapes
    config = LlamaConfig.tiny(
        61, hidden_size=18, num_hidden_layers=layers, num_attention_heads=3,
        num_key_value_heads=1, intermediate_size=30, max_position_embeddings=16,
        param_dtype=jnp.float32,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    model.scan_layers = scan
    return model


def _matrices(params):
    """Muon's leaves, as the trainer picks them: the blocks' matrices (logical rank 2 per
    layer), not the embedding, whose tied table FSDP lists under ``lm_head``."""

    def pick(path, x):
        path = jax.tree_util.keystr(path)
        rank = len(x.logical_shape) if _is_sp(x) else x.ndim - ("['layers']['" in path)
        return rank == 2 and not path.startswith(("['lm_head']", "['model']['embed_tokens']"))

    return jax.tree_util.tree_map_with_path(pick, params, is_leaf=_is_sp)


def _unshard(tree):
    return jax.tree.map(
        lambda x: jnp.asarray(x.unshard()) if _is_sp(x) else x, tree, is_leaf=_is_sp
    )


def _shard_like(mesh, full, like):
    """``full``'s values in ``like``'s layout: ShardedParameters (stacked where they are)
    where it has them, whole arrays elsewhere."""
    put = lambda x, p: SP.from_full(x, mesh, AX, stacked=p.stacked) if _is_sp(p) else x
    return jax.tree.map(put, full, like)


def _run_both(mesh, sharded, full, tx, ref, steps):
    """``steps`` updates of both optimizers on the same random gradients; both results."""
    rng = np.random.default_rng(0)
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    # the step counts replicated, as the update returns them (the trainer's place())
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, replicated), tx.init(sharded))
    ref_state = ref.init(full)
    for _ in range(steps):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), full)
        updates, state = update(_shard_like(mesh, grads, sharded), state, sharded)
        sharded = optax.apply_updates(sharded, updates)
        ref_updates, ref_state = ref_update(grads, ref_state, full)
        full = optax.apply_updates(full, ref_updates)
    assert update._cache_size() == 1  # the second and third update reuse the first's program
    return sharded, state, full


def _assert_close(sharded, full, **tol):
    got = jax.tree_util.tree_flatten_with_path(_unshard(sharded))[0]
    want = jax.tree.leaves(full)
    assert len(got) == len(want)
    for (path, g), w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **tol, err_msg=jax.tree_util.keystr(path))


def _assert_sharded_like_params(state, params):
    """Every array of the state that mirrors a parameter is split as it is: 1/N per device."""
    shapes = {tuple(x.local.shape) for x in jax.tree.leaves(params, is_leaf=_is_sp)}
    mirrored = [x for x in jax.tree.leaves(state) if x.ndim]
    assert mirrored and all(tuple(x.shape) in shapes for x in mirrored)
    for x in mirrored:
        assert x.addressable_shards[0].data.shape == (*x.shape[:-1], x.shape[-1] // N)


# --------------------------------------------------------------------- equal to one device


@pytest.mark.parametrize(
    ("layers", "scan"),
    [(1, False), (5, False), (5, True)],
    ids=["7-matrices-plain", "35-matrices-plain", "35-matrices-stacked"],
)
def test_llama_steps_equal_one_device_muon(layers, scan):
    mesh = _mesh()
    sharded = shard(_llama(layers, scan=scan), rs.ShardingContext(mesh, AX))
    params = nnx.state(sharded, nnx.Param)
    full = _unshard(params)  # the same tree, each ShardedParameter's whole value (L, m, n)
    mask = _matrices(params)
    kw = dict(muon_mask=mask, mask=mask, stacked=scan, ns_dtype=jnp.float32,
              adamw_learning_rate=1e-3)  # fmt: skip
    tx = rs.fsdp_muon(LR, mesh=mesh, **kw)
    out, state, want = _run_both(mesh, params, full, tx, ro.muon(LR, **kw), steps=3)
    _assert_close(out, want, **TOL)
    _assert_sharded_like_params(state, params)
    # Muon moved every matrix (the comparison is not of untouched trees)
    moved = [np.max(np.abs(a - b)) for a, b, to_muon in zip(
        jax.tree.leaves(want), jax.tree.leaves(full), jax.tree.leaves(mask), strict=True
    ) if to_muon]  # fmt: skip
    assert len(moved) == 7 * (1 if scan else layers) and min(moved) > 1e-3


def _edge_tree():
    """More matrices of a shape than devices (17, a leftover of 1) and fewer (2), a tall and
    a wide one, a matrix of 6 elements (< 8 shards: two shards hold only padding), an empty
    one, a stack of 3 layers whose matrices are themselves stacks (2, 11, 5), and a vector
    AdamW steps, kept whole (not a ShardedParameter)."""
    rng = np.random.default_rng(1)
    shapes = {f"a{i:02d}": (7, 5) for i in range(17)}
    shapes |= {"tall0": (13, 9), "tall1": (13, 9), "wide": (9, 13), "tiny": (2, 3),
               "empty": (0, 4), "stack": (3, 2, 11, 5), "vector": (5,)}  # fmt: skip
    full = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    return full


@pytest.mark.parametrize(
    ("mesh_kind", "ns_dtype"),
    [("auto", jnp.float32), ("explicit", jnp.float32), ("data_x_fsdp", jnp.float32),
     ("auto", jnp.bfloat16)],
)  # fmt: skip
def test_leftovers_padding_and_stacks_equal_one_device(mesh_kind, ns_dtype):
    mesh = _mesh(mesh_kind)
    full = _edge_tree()
    sharded = {
        k: SP.from_full(v, mesh, AX, stacked=k == "stack") for k, v in full.items() if k != "vector"
    }
    # a whole leaf beside the shards, replicated as the update returns it (AdamW's moments
    # of it on an Explicit mesh as P(None), on an Auto one as P(): rudax.optim.adamw's too)
    whole = P(None) if mesh_kind == "explicit" else P()
    sharded["vector"] = jax.device_put(full["vector"], NamedSharding(mesh, whole))
    mask = {k: k != "vector" for k in full}
    kw = dict(muon_mask=mask, stacked=True, ns_dtype=ns_dtype, weight_decay=0.1)
    tx = rs.fsdp_muon(LR, mesh=mesh, **kw)
    out, state, want = _run_both(mesh, sharded, full, tx, ro.muon(LR, **kw), steps=3)
    # bf16: the two programs may round a bf16 matmul differently; one bf16 ulp (2**-8
    # relative) of an update of size lr * r (r <= 1.45 here) per step
    tol = TOL if ns_dtype == jnp.float32 else dict(rtol=0, atol=3 * LR * 1.45 * 2**-8)
    _assert_close(out, want, **tol)
    assert out["empty"].unshard().shape == (0, 4)
    for name in ("a00", "tiny", "stack"):  # padding stays zero: its gradient and update are 0
        p = out[name]
        padded = np.asarray(p.local)[..., p.size :]
        assert padded.size and not np.any(padded), name
    muon_state = [s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "momentum"))
                  if hasattr(s, "momentum")]  # fmt: skip
    (momentum,) = [s.momentum for s in muon_state]
    shards = mesh.shape[AX]
    assert momentum["a00"].local.addressable_shards[0].data.shape == (math.ceil(35 / shards),)


def test_an_fsdp_axis_of_one_device():
    """The trainer shards whenever its mesh has an ``fsdp`` axis, of size 1 too."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]).reshape(N, 1), ("data", AX))
    full = {"w": jax.random.normal(jax.random.key(0), (6, 5)), "stack": jnp.ones((3, 4, 5))}
    params = {k: SP.from_full(x, mesh, AX, stacked=k == "stack") for k, x in full.items()}
    tx = rs.fsdp_muon(LR, mesh=mesh, stacked=True, ns_dtype=jnp.float32)
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    ref = ro.muon(LR, stacked=True, ns_dtype=jnp.float32)
    want, _ = ref.update(full, ref.init(full), full)
    for k in full:
        np.testing.assert_allclose(updates[k].unshard(), want[k], **TOL, err_msg=k)


# --------------------------------------------------------------------- the work is divided


def _computations(hlo):
    """{instruction name: shape} per computation of an HLO module's text, and its dots."""
    shapes, dots = {}, []
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            shapes = {}  # a new computation: names are local to it
            for name, shape in re.findall(r"(\S+): \w+\[([\d,]*)\]", line):
                shapes["%" + name] = shape
            continue
        m = re.match(r"\s*(?:ROOT )?(%\S+) = \w+\[([\d,]*)\]\S* (\S+?)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op == "dot":
            lhs = re.match(r"(%[^,)\s]+)", rest).group(1)
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
            dims = lambda s: [int(d) for d in s.split(",") if d]
            lhs_shape = dims(shapes[lhs])
            k = math.prod(lhs_shape[int(c)] for c in dims(contracting))
            dots.append(2 * math.prod(dims(shape)) * k)
    return dots


def _ns_flops(shape, steps=5):
    """The matmul flops of ``steps`` quintic iterations on an (m, n) matrix, m <= n after the
    transpose: X X^T (m*m*n), G G (m^3), P X (m*m*n), two flops a multiply-add."""
    m, n = sorted(shape)
    return steps * 2 * (2 * m * m * n + m**3)


def test_newton_schulz_work_is_divided_between_the_devices():
    mesh = _mesh()
    sharded = shard(_llama(3), rs.ShardingContext(mesh, AX))
    params = nnx.state(sharded, nnx.Param)
    full = _unshard(params)
    mask = _matrices(params)
    kw = dict(muon_mask=mask, ns_dtype=jnp.float32)
    tx, ref = rs.fsdp_muon(LR, mesh=mesh, **kw), ro.muon(LR, **kw)
    hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    ref_hlo = jax.jit(ref.update).lower(full, ref.init(full), full).compile().as_text()

    # 3 layers: (18, 18) x6, (18, 6) x6, (18, 30) x6, (30, 18) x3 = 21 matrices, each of the
    # four shapes fewer than 8: one round of each shape per device, one Newton-Schulz each
    # (in a conditional its device skips unless it was dealt one of that round's).
    counts = {(18, 18): 6, (18, 6): 6, (18, 30): 6, (30, 18): 3}
    one_device = sum(c * _ns_flops(s) for s, c in counts.items())
    per_device = sum(math.ceil(c / N) * _ns_flops(s) for s, c in counts.items())
    assert sum(_computations(ref_hlo)) == one_device
    assert sum(_computations(hlo)) == per_device  # the SPMD program: one device's
    assert per_device * 4 < one_device
    # each matrix crosses the axis in one all-to-all and back; no device gathers them all
    assert " all-to-all(" in hlo and " all-gather(" not in hlo
    # the four shapes' rounds are partial: each a conditional its undealt devices skip
    assert hlo.count(" conditional(") == 4


def test_leftovers_go_to_the_devices_after_the_previous_shape():
    from rudax.sharding._muon import FSDPMatrices

    mesh = _mesh()
    value = lambda *s: SP.from_full(jnp.zeros(s), mesh, AX)
    params = [value(7, 5)] * 10 + [value(3, 4)] * 3 + [value(7, 5)] + [value(2, 2)] * 4
    groups = FSDPMatrices(mesh, AX)._deal(params)
    assert [g.shape for g in groups] == [(7, 5), (3, 4), (2, 2)]  # first seen first
    assert groups[0].devices == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]
    assert groups[1].devices == [3, 4, 5]
    assert groups[2].devices == [6, 7, 0, 1]
    # 18 matrices on 8 devices: no device holds more than 3 (ceil(18 / 8))
    load = np.bincount([d for g in groups for d in g.devices], minlength=N)
    assert load.max() == 3 and load.sum() == 18


# --------------------------------------------------------------------- real FSDP gradients


def test_train_steps_on_fsdp_gradients_equal_one_device():
    """The trainer's flow: gradients reduce-scattered by the sharded model, fsdp_muon in the
    same jit; the one-device model and ro.muon on the same batches. The gradients themselves
    differ in rounding (test_shard: rtol 1e-4), so the tolerance is theirs."""
    mesh = _mesh()
    model = _llama(1)
    sharded = shard(model, rs.ShardingContext(mesh, AX))
    rng = np.random.default_rng(0)
    batches = [
        {"tokens": rng.integers(0, 61, (N, 9)), "labels": rng.integers(0, 61, (N, 9))}
        for _ in range(3)
    ]

    def trained(m, make_tx, loss):
        graph, params, rest = nnx.split(m, nnx.Param, ...)
        tx = make_tx(_matrices(params))
        state = tx.init(params)

        @jax.jit
        def step(params, state, batch):
            grads = jax.grad(lambda p: loss(graph, p, rest, batch))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for batch in batches:
            params, state = step(params, state, batch)
        return nnx.merge(graph, params, rest)

    def sharded_loss(graph, p, rest, batch):
        local = lambda p, r, b: causal_lm_loss_sum(nnx.merge(graph, p, r), b)[0][None]
        specs = (rs.shard_specs(p), rs.shard_specs(rest), P(AX))
        placed = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P(AX)))
        return jnp.sum(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(AX))(
            p, rest, placed))  # fmt: skip

    def one_device_loss(graph, p, rest, batch):
        return causal_lm_loss_sum(nnx.merge(graph, p, rest), batch)[0]

    kw = dict(ns_dtype=jnp.float32, adamw_learning_rate=1e-3)
    got = trained(sharded, lambda m: rs.fsdp_muon(LR, mesh=mesh, muon_mask=m, **kw), sharded_loss)
    want = trained(model, lambda m: ro.muon(LR, muon_mask=m, **kw), one_device_loss)
    values = {}
    for prefix, node in nnx.iter_graph(got):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                values[(*prefix, *path)] = var.get_value().unshard()
    flat = nnx.to_flat_state(nnx.state(want, nnx.Param))
    assert len(flat) == 11 and set(dict(flat)) <= set(values)  # 9 a layer, table, final norm
    q = ("model", "layers", 0, "self_attn", "q_proj", "kernel")
    start = np.asarray(model.model.layers[0].self_attn.q_proj.kernel)
    assert np.max(np.abs(values[q] - start)) > 1e-2  # trained: Muon moved it
    for path, var in flat:
        np.testing.assert_allclose(values[path], var.get_value(), rtol=1e-4, atol=1e-5,
                                   err_msg=str(path))  # fmt: skip


# --------------------------------------------------------------------- the API


def test_signature_is_muons_with_mesh_and_axis_name():
    ours = inspect.signature(rs.fsdp_muon).parameters
    theirs = inspect.signature(ro.muon).parameters
    assert [n for n in ours if n not in ("mesh", "axis_name")] == list(theirs)
    for name, p in theirs.items():
        assert (ours[name].default, ours[name].kind) == (p.default, p.kind), name
    assert ours["mesh"].default is inspect.Parameter.empty
    assert ours["mesh"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.standard_promotion  # optax's inject_hyperparams mixes dtypes in its own code
def test_inject_hyperparams_keeps_mesh_static():
    mesh = _mesh()
    full = {"w": jnp.ones((6, 5)), "b": jnp.zeros(5)}
    params = jax.tree.map(lambda x: SP.from_full(x, mesh, AX), full)
    tx = ro.inject_hyperparams(rs.fsdp_muon)(learning_rate=LR, mesh=mesh, ns_dtype=jnp.float32)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.float32(2 * LR)
    updates, _ = jax.jit(tx.update)(params, state, params)
    plain = rs.fsdp_muon(2 * LR, mesh=mesh, ns_dtype=jnp.float32)
    want, _ = plain.update(params, plain.init(params), params)
    np.testing.assert_allclose(updates["w"].unshard(), want["w"].unshard(), rtol=1e-6)


def test_bad_inputs_are_named():
    mesh = _mesh()
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
        rs.fsdp_muon(LR, mesh="fsdp")
    with pytest.raises(ValueError, match=r"axis_name must be one of the mesh's axes.*'model'"):
        rs.fsdp_muon(LR, mesh=mesh, axis_name="model")
    with pytest.raises(TypeError, match=r"fsdp_muon: ns_steps shapes the compiled program"):
        rs.fsdp_muon(LR, mesh=mesh, ns_steps=jnp.int32(5))

    # sharded over 4 devices, the optimizer's axis has 8
    four = jax.sharding.Mesh(np.array(jax.devices()[:4]), (AX,))
    params = {"block": {"w": SP.from_full(jnp.ones((6, 5)), four, AX)}}
    with pytest.raises(ValueError, match=r"params\['block'\]\['w'\] is sharded over axis "
                       r"'fsdp' in 4 slices; .*of size 8"):  # fmt: skip
        rs.fsdp_muon(LR, mesh=mesh).init(params)
    # sharded over another axis of the mesh
    grid = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", AX))
    params = {"w": SP.from_full(jnp.ones((6, 5)), grid, "data")}
    with pytest.raises(ValueError, match=r"params\['w'\] is sharded over axis 'data'"):
        rs.fsdp_muon(LR, mesh=grid).init(params)

    # a vector sent to Muon: its logical shape is named, not its storage's
    params = {
        "w": SP.from_full(jnp.ones((6, 5)), mesh, AX),
        "b": SP.from_full(jnp.ones(5), mesh, AX),
    }
    with pytest.raises(ValueError, match=r"params\['b'\] has shape \(5,\)"):
        rs.fsdp_muon(LR, mesh=mesh, muon_mask={"w": True, "b": True}).init(params)
    # a stack of layers needs stacked=True, as one device's (L, m, n) does
    params = {"w": SP.from_full(jnp.ones((3, 6, 5)), mesh, AX, stacked=True)}
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(3, 6, 5\).*stacked=True"):
        rs.fsdp_muon(LR, mesh=mesh, muon_mask={"w": True}).init(params)
    # a mask mapped over the shards' arrays instead of one bool per ShardedParameter
    params = {"w": SP.from_full(jnp.ones((6, 5)), mesh, AX)}
    over_arrays = lambda p: jax.tree.map(lambda x: True, p)
    with pytest.raises(TypeError, match=r"muon_mask\['w'\] must be a bool, got a "
                       r"ShardedParameter: map the mask with is_leaf"):  # fmt: skip
        rs.fsdp_muon(LR, mesh=mesh, muon_mask=over_arrays).init(params)
