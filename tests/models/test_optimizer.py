"""rudax.models.decay_mask and its use by every ``OptimizerSpec``: what weight decay shrinks.

The mask is checked leaf by leaf against a table written out here, for the dense and the MoE
model and for the FSDP-sharded one (a ``ShardedParameter`` one leaf of the mask). The
optimizers are checked by what they do, several updates in: with zero gradients Adam's and
Muon's directions are 0, so a decayed parameter is its initial value times
``prod_t (1 - lr_t wd)`` and a spared one stays put; with real gradients a spared parameter
moves exactly as with ``--weight-decay 0``. On the dense model Muon's recipe is unchanged:
AdamW's part holds only the embedding and the norms, which decay nowhere.
"""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from rudax.models import LlamaConfig, ModelSpec, OptimizerSpec, _optimizer, decay_mask

DENSE = LlamaConfig.tiny(
    64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8
)
MOE = dict(
    model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True
)
# Peak lr from the first update (no warmup); the models in fp32 storage (FP32) so the
# parameters are the masters.
OPT = dict(steps=8, warmup_steps=0, learning_rate=1e-2, muon_learning_rate=0.05, weight_decay=0.1)
FP32 = dict(param_dtype=jnp.float32)
UPDATES = 3

# Every parameter of the 1-layer models and whether it decays. The tied embedding is listed
# once, under lm_head (nnx's first path to it in sorted order).
LAYER = "['model']['layers'][0]"
DENSE_MASK = {
    "['lm_head']['embedding']": False,
    "['model']['norm']['scale']": False,
    f"{LAYER}['input_layernorm']['scale']": False,
    f"{LAYER}['post_attention_layernorm']['scale']": False,
    **{f"{LAYER}['self_attn']['{p}_proj']['kernel']": True for p in "qkvo"},
    **{f"{LAYER}['mlp']['{p}_proj']['kernel']": True for p in ("gate", "up", "down")},
}
MOE_MASK = {
    **{k: v for k, v in DENSE_MASK.items() if "['mlp']" not in k},
    f"{LAYER}['block_sparse_moe']['gate']['kernel']": True,
    **{f"{LAYER}['block_sparse_moe']['experts']['w{i}']": True for i in (1, 2, 3)},
}
# FSDP's modules hold their parameters as ['variables'][i]; the MoE block's are the router
# and the three stacked experts.
FSDP_MOE_MASK = {
    "['lm_head']['variables'][0]": False,
    "['model']['norm']['variables'][0]": False,
    f"{LAYER}['input_layernorm']['variables'][0]": False,
    f"{LAYER}['post_attention_layernorm']['variables'][0]": False,
    **{f"{LAYER}['self_attn']['{p}_proj']['variables'][0]": True for p in "qkvo"},
    **{f"{LAYER}['block_sparse_moe']['variables'][{i}]": True for i in range(4)},
}
# What --optimizer muon steps with Muon in the MoE model; the rest goes to its AdamW.
MOE_MUON_TAKES = {f"{LAYER}['self_attn']['{p}_proj']['kernel']" for p in "qkvo"}


def _config(**fields):
    return dataclasses.replace(DENSE, **fields)


def _params(config, mesh=None):
    model = ModelSpec(config, 8).create(0)
    if mesh is not None:  # the trainer's FSDP form: gathered in fp32
        model = rm.shard(model, rs.ShardingContext(mesh, "fsdp"), compute_dtype=jnp.float32)
    params = nnx.state(model, nnx.Param)
    return params if mesh is None else rs.place(params, mesh)


def _by_path(tree, is_leaf=None):
    """{path without the trailing .value: leaf} of an nnx.State."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {jax.tree_util.keystr(path).removesuffix(".value"): x for path, x in flat}


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))


def _run(tx, params, grads, updates=UPDATES):
    """The parameters after `updates` updates with the same gradients each time."""
    update = jax.jit(lambda p, s: tx.update(grads, s, p))
    state = tx.init(params)
    for _ in range(updates):
        u, state = update(params, state)
        params = optax.apply_updates(params, u)
    return params


def _gradients(params):
    """Gradients of 0.01 standard deviation, in each parameter's dtype."""
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    return jax.tree.map(
        lambda p: (1e-2 * jax.random.normal(next(keys), p.shape)).astype(p.dtype), params
    )


def _shrink(opt, peak):
    """prod_{t=1..UPDATES} (1 - lr_t wd) in float64, lr_t the schedule's value at t - 1."""
    schedule = opt.schedule(peak)
    lrs = [float(schedule(t)) for t in range(UPDATES)]
    return float(np.prod([1.0 - lr * opt.weight_decay for lr in lrs]))


@pytest.mark.parametrize("fields, want", [({}, DENSE_MASK), (MOE, MOE_MASK)], ids=["dense", "moe"])
def test_mask_decays_the_matrices_not_the_norms_or_the_embedding(fields, want):
    params = _params(_config(**fields))
    assert _by_path(decay_mask(params)) == want


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_mask_over_fsdp_has_one_bool_per_sharded_parameter():
    params = _params(_config(**MOE), _mesh())
    mask = decay_mask(params)
    assert _by_path(mask) == FSDP_MOE_MASK
    # A prefix of the parameters' tree: each bool stands where a ShardedParameter does.
    covered = jax.tree.structure(mask).flatten_up_to(params)
    assert all(isinstance(x, rs.ShardedParameter) for x in covered)


def _expected_shrink(opt, path):
    """What UPDATES zero-gradient updates multiply the MoE parameter at `path` by (1: spared)."""
    if not MOE_MASK[path]:
        return 1.0
    # Muon takes the attention's matrices, at its own lr; AdamW the router and the experts.
    muon = opt.name == "muon" and path in MOE_MUON_TAKES
    return _shrink(opt, opt.muon_learning_rate if muon else opt.learning_rate)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "fused_adamw"])
def test_zero_gradients_shrink_decayed_parameters_and_leave_the_rest(optimizer):
    # The MoE model has every kind of parameter but the dense MLP's, which
    # test_dense_muon_is_modded_nanogpts_recipe_bit_for_bit covers.
    opt = OptimizerSpec(optimizer, **OPT)
    params = _params(_config(**FP32, **MOE))
    zeros = jax.tree.map(jnp.zeros_like, params)
    before, after = _by_path(params), _by_path(_run(opt.build(), params, zeros))
    assert before.keys() == MOE_MASK.keys()
    for path, p0 in before.items():
        p0 = np.asarray(p0, np.float64)
        factor = _expected_shrink(opt, path)
        if factor == 1.0:
            np.testing.assert_array_equal(after[path], p0, err_msg=path)
        else:
            assert factor < 0.999  # the decay is large enough to see
            np.testing.assert_allclose(after[path], p0 * factor, rtol=1e-6, err_msg=path)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "fused_adamw"])
def test_spared_parameters_step_as_without_weight_decay(optimizer):
    opt = OptimizerSpec(optimizer, **OPT)
    no_decay = dataclasses.replace(opt, weight_decay=0.0)
    params = _params(_config(**FP32, **MOE))
    grads = _gradients(params)
    decayed = _by_path(_run(opt.build(), params, grads))
    spared = _by_path(_run(no_decay.build(), params, grads))
    before = _by_path(params)
    for path, decays in MOE_MASK.items():
        assert not np.array_equal(decayed[path], before[path]), path  # every leaf steps
        if decays:
            assert not np.array_equal(decayed[path], spared[path]), path
        else:
            np.testing.assert_array_equal(decayed[path], spared[path], err_msg=path)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("optimizer", ["adamw", "fused_adamw"])
def test_fsdp_zero_gradients_shrink_only_the_masked_in_sharded_parameters(optimizer):
    opt = OptimizerSpec(optimizer, **OPT)
    mesh = _mesh()
    params = _params(_config(**FP32, **MOE), mesh)
    zeros = jax.tree.map(jnp.zeros_like, params)
    is_sharded = lambda x: isinstance(x, rs.ShardedParameter)
    before = _by_path(params, is_sharded)
    after = _by_path(_run(opt.build(mesh), params, zeros), is_sharded)
    factor = _shrink(opt, opt.learning_rate)
    for path, decays in FSDP_MOE_MASK.items():
        p0, p3 = np.asarray(before[path].local, np.float64), np.asarray(after[path].local)
        if decays:
            np.testing.assert_allclose(p3, p0 * factor, rtol=1e-6, err_msg=path)
        else:
            np.testing.assert_array_equal(p3, p0, err_msg=path)


def test_dense_muon_is_modded_nanogpts_recipe_bit_for_bit():
    """On the dense model AdamW's part holds the embedding and the norms: no decay there, as
    modded-nanogpt's Adam (and this trainer's muon before decay_mask), to the bit."""
    opt = OptimizerSpec("muon", **OPT)
    params = _params(DENSE)  # bf16 storage with fp32 masters, the main job's
    keystr = jax.tree_util.keystr
    matrices = lambda ps: jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim == 2 and "embed" not in keystr(path), ps
    )
    plain = ro.fp32_master(
        optax.chain(
            ro.clip_by_global_norm(opt.max_grad_norm),
            ro.muon(
                opt.schedule(opt.muon_learning_rate),
                weight_decay=opt.weight_decay,
                muon_mask=matrices,
                adamw_learning_rate=opt.schedule(opt.learning_rate),
                adamw_b1=opt.b1,
                adamw_b2=opt.b2,
                adamw_eps=opt.eps,
                adamw_weight_decay=0.0,
            ),
        )
    )
    grads = _gradients(params)
    got, want = (
        _by_path(_run(opt.build(), params, grads)),
        _by_path(_run(plain, params, grads)),
    )
    assert got.keys() == DENSE_MASK.keys()
    assert got["['model']['norm']['scale']"].dtype == jnp.bfloat16
    for path, x in want.items():
        np.testing.assert_array_equal(got[path], x, err_msg=path)


def test_docstring_examples():
    assert doctest.testmod(_optimizer, raise_on_error=True).attempted > 0


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(name="sgd"),
            r"name must be one of \('adamw', 'muon', 'fused_adamw'\), got name='sgd'",
        ),
        (dict(steps=0), "steps must be positive, got steps=0"),
        (dict(warmup_steps=-1), "warmup_steps must be a non-negative int, got warmup_steps=-1"),
        (dict(steps=1.5), "steps must be a non-negative int, got steps=1.5"),
    ],
)
def test_a_bad_field_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        OptimizerSpec(**fields)
