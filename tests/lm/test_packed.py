"""Packed rows (segment ids, per-token RoPE positions) and ``labelled_loss_sum`` (issue 14).

The references are independent of the packing code: each example run alone, unpacked, by
the plain model (the same arithmetic per example, so the bound is a few fp32 ulps of the
logits); transformers' ``LlamaForCausalLM`` with torch's cross entropy and
``ignore_index=-100``; and one device for the FSDP form. Every model is tiny and fp32. The
layer's packed arithmetic (RoPE at given positions, segment-masked attention) is checked
against NumPy in tests/layers/test_attention.py and test_rope.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the reference extra: required, never skipped (the tests run in CI)
import transformers
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from examples.lm.hf import load_hf
from examples.lm.model import GPT, GPTConfig, labelled_loss_sum, shard

V, T = 32, 16
F = jnp.float32
F32 = dict(param_dtype=F, dtype=F)
# One block (compiling dominates these tests) but for "dense", where a second block checks
# that every block gets the segments and positions.
TINY = dict(vocab_size=V, seq_len=T, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32, **F32)
# head_dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5 against L / 4 = 64 and L = 256,
# so the rewrite keeps one frequency, blends one and divides two (as in tests/lm/test_hf.py).
LLAMA3 = rl.Llama3RopeScaling(8.0, 1.0, 4.0, 256)
CONFIGS = {
    "dense": dict(n_layers=2),
    "gqa": dict(n_heads=4, n_kv_heads=2, fused_qkv=False, tie_embeddings=False),
    "llama3": dict(n_kv_heads=1, rope_theta=5e5, rope_scaling=LLAMA3),
}
# A packed row: example a, example b (6 tokens each), 4 tokens of padding; the second row
# packs them the other way round, so each example sits at offsets 0 and 6. One length for
# both, so the two examples alone are one unpacked batch [2, 6] (one compilation).
A = B = 6


def _config(**overrides):
    return GPTConfig(**{**TINY, **overrides})


def _model(config, seed=0):
    """A GPT with every parameter N(0, 0.3): scores of a few units (GPT-2's N(0, 0.02) gives
    near-uniform attention, in which positions and masks hardly show). Built abstractly:
    an eager init compiles each of its ops, which costs more than the tests."""
    graph, state = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, V, size=n, dtype=np.int32)


def _packed(a, b):
    """tokens, segment_ids, positions [2, T] of the rows [a b pad] and [b a pad]."""
    pad = T - len(a) - len(b)
    rows = [
        (np.concatenate([a, b, np.zeros(pad, np.int32)]), [len(a), len(b)]),
        (np.concatenate([b, a, np.zeros(pad, np.int32)]), [len(b), len(a)]),
    ]
    tokens = np.stack([r for r, _ in rows])
    seg = np.stack([np.repeat([1, 2, 0], [*n, pad]) for _, n in rows]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(k) for k in (*n, pad)]) for _, n in rows])
    return tokens, seg, pos.astype(np.int32) * (seg > 0)


_plain = nnx.jit(lambda model, tokens: model(tokens)[0])
_packed_logits = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p)[0])


# --------------------------------------------------------------------- the packed model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_packed_example_has_the_logits_it_has_alone(name):
    model = _model(_config(**CONFIGS[name]))
    a, b = _ids(A, 1), _ids(B, 2)
    tokens, seg, pos = _packed(a, b)
    got = np.asarray(_packed_logits(model, tokens, seg, pos))
    alone_a, alone_b = np.asarray(_plain(model, np.stack([a, b])))  # rows never interact
    scale = max(np.abs(alone_a).max(), np.abs(alone_b).max())
    # The same arithmetic per example up to summation order (other matmul and softmax
    # lengths; the masked keys add exact zeros): 1e-6 of the largest logit is ~8 fp32 ulps
    # of it (measured on CPU: <= 2.2e-7, under 2 ulps).
    for row, (first, second) in enumerate([(alone_a, alone_b), (alone_b, alone_a)]):
        n = len(first)
        np.testing.assert_allclose(got[row, :n], first, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(got[row, n : n + len(second)], second, rtol=0, atol=1e-6 * scale)
    assert np.isfinite(got).all()  # padding (segment 0) included
    # Without the segments (one sequence per row), b reads a: the mask is what separates them.
    unmasked = np.asarray(_packed_logits(model, tokens, np.ones_like(seg), pos))
    assert np.abs(unmasked[0, A : A + B] - alone_b).max() > 1e-2 * scale
    # RoPE sees only offsets within a segment, so restarting the positions shows in rounding
    # alone. Positions with gaps show that they reach RoPE in every block: b given positions
    # 0, 2, 4, ... equals b placed at 0, 2, 4, ... of a row (positions 0 .. T-1) with a
    # token of another segment in each gap, and differs from b at 0, 1, 2, ...
    spread = np.zeros((2, T), np.int32)
    spread[0, : 2 * B : 2], spread[0, 1 : 2 * B : 2] = b, _ids(B, 5)
    spread[1, :B] = b
    spread_seg = np.zeros((2, T), np.int32)
    spread_seg[0, : 2 * B] = np.where(np.arange(2 * B) % 2, np.arange(2 * B) + 2, 1)
    spread_seg[1, :B] = 1
    spread_pos = np.zeros((2, T), np.int32)
    spread_pos[0] = np.arange(T)
    spread_pos[1, :B] = 2 * np.arange(B)
    got = np.asarray(_packed_logits(model, spread, spread_seg, spread_pos))
    np.testing.assert_allclose(got[1, :B], got[0, : 2 * B : 2], rtol=0, atol=1e-6 * scale)
    assert np.abs(got[1, :B] - alone_b).max() > 1e-2 * scale


@pytest.mark.parametrize("name", ["dense", "llama3"])
def test_one_segment_at_positions_0_to_T_is_the_plain_call_bit_for_bit(name):
    # The packed path's RoPE reads rows of the plain path's constant table and its mask is
    # the causal mask: nothing differs, not even rounding (fp32 angles computed from the
    # positions would differ by ulps).
    model = _model(_config(**CONFIGS[name]))
    tokens = np.random.default_rng(3).integers(0, V, size=(2, T), dtype=np.int32)
    seg = np.ones((2, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
    np.testing.assert_array_equal(
        np.asarray(_packed_logits(model, tokens, seg, pos)), np.asarray(_plain(model, tokens))
    )


# -------------------------------------------------------------------- labelled_loss_sum


def _labelled(tokens, seg, pos, counted_from):
    """labels: the next token of the same example, counted from position counted_from on."""
    labels = np.full(tokens.shape, -100, np.int32)
    same_next = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)
    take = same_next & (pos[:, :-1] >= counted_from)
    labels[:, :-1] = np.where(take, tokens[:, 1:], -100)
    return dict(tokens=tokens, labels=labels, segment_ids=seg, positions=pos)


def _alone(*examples):
    """tokens, segment_ids, positions of one unpacked example per row."""
    tokens = np.stack(examples)
    seg = np.ones(tokens.shape, np.int32)
    return tokens, seg, np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), seg.shape)


_loss_and_grad = nnx.jit(
    lambda model, batch: nnx.value_and_grad(labelled_loss_sum, has_aux=True)(model, batch)
)


_loss = nnx.jit(labelled_loss_sum)
# GQA, separate q/k/v and an untied head; chunks of 4 tokens in the fused loss. One model
# (one compilation per shape) for the tests below; its parameters are _model(CONFIGS["gqa"])'s.
GRAD_CONFIG = _config(**CONFIGS["gqa"], loss_chunk=4)


def test_labelled_loss_is_numpy_cross_entropy_of_the_packed_logits():
    batch = _labelled(*_packed(_ids(A, 1), _ids(B, 2)), counted_from=2)
    (loss, metrics), _ = _loss_and_grad(_model(GRAD_CONFIG), batch)  # chunks of 4 of 32 tokens
    same = _model(_config(**CONFIGS["gqa"]))  # the same parameters
    logits = _packed_logits(same, batch["tokens"], batch["segment_ids"], batch["positions"])
    logits = np.asarray(logits, np.float64).reshape(-1, V)
    labels = batch["labels"].reshape(-1)
    counted = labels != -100
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = np.sum((lse - logits[np.arange(len(labels)), np.maximum(labels, 0)])[counted])
    n = int(counted.sum())
    assert n == 2 * ((A - 3) + (B - 3)) and metrics["tokens"].dtype == jnp.int32
    assert int(metrics["tokens"]) == n
    np.testing.assert_allclose(float(metrics["ce_sum"]), ce, rtol=1e-5)
    assert float(loss) == float(metrics["ce_sum"]) and float(metrics["aux_loss"]) == 0.0


def test_moe_term_is_weighted_by_the_counted_tokens():
    model = _model(_config(num_experts=4, top_k=2, moe_aux_weight=0.5))
    tokens, seg, pos = _packed(_ids(A, 1), _ids(B, 2))
    loss, metrics = _loss(model, _labelled(tokens, seg, pos, counted_from=2))
    n, aux = int(metrics["tokens"]), float(metrics["aux_loss"])
    assert n == 2 * ((A - 3) + (B - 3)) and aux > 0
    np.testing.assert_allclose(float(loss), float(metrics["ce_sum"]) + 0.5 * n * aux, rtol=1e-6)
    # Nothing counted: no term at all, though the router balanced the same tokens (padding
    # included) just as much; a weight of B * T tokens would leave 0.5 * 32 * aux here.
    loss, metrics = _loss(model, _labelled(tokens, seg, pos, counted_from=T))
    assert int(metrics["tokens"]) == 0 and float(loss) == 0.0
    assert float(metrics["aux_loss"]) == aux


def test_packed_gradient_is_the_sum_of_each_example_alone():
    model = _model(GRAD_CONFIG)
    a, b = _ids(A, 1), _ids(B, 2)
    (loss, metrics), grads = _loss_and_grad(model, _labelled(*_packed(a, b), 1))
    # a and b alone, one unpacked row each (rows are independent: the batch's loss and
    # gradient are the sums of its rows'); the packed batch holds each example twice.
    (alone_loss, alone_metrics), alone_grads = _loss_and_grad(model, _labelled(*_alone(a, b), 1))
    assert int(metrics["tokens"]) == 2 * int(alone_metrics["tokens"]) == 2 * (A - 2 + B - 2)
    np.testing.assert_allclose(float(loss), 2 * float(alone_loss), rtol=1e-5)
    got, want = nnx.to_flat_state(grads), dict(nnx.to_flat_state(alone_grads))
    assert len(got) == len(want) > 0
    for path, g in got:
        w = 2 * np.asarray(want[path].get_value())
        scale = np.abs(w).max()
        assert scale > 0, path
        np.testing.assert_allclose(
            np.asarray(g.get_value()), w, rtol=0, atol=1e-5 * scale, err_msg=str(path)
        )


def test_nothing_counted_gives_zero_loss_and_zero_finite_gradients():
    model = _model(GRAD_CONFIG)
    batch = _labelled(*_packed(_ids(A, 1), _ids(B, 2)), counted_from=T)  # every label -100
    assert (batch["labels"] == -100).all()
    (loss, metrics), grads = _loss_and_grad(model, batch)
    assert float(loss) == 0.0 and float(metrics["ce_sum"]) == 0.0
    assert int(metrics["tokens"]) == 0
    for leaf in jax.tree.leaves(grads):
        assert np.isfinite(leaf).all() and not np.asarray(leaf).any()


N = 2  # one packed row per rank


@pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")
def test_sharded_labelled_loss_and_gradients_equal_one_device():
    # An untied head, gathered for the fused loss as loss_sum gathers it.
    model = _model(GRAD_CONFIG)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    sharded = shard(model, rs.ShardingContext(mesh, "fsdp"))
    batch = _labelled(*_packed(_ids(A, 1), _ids(B, 2)), 1)

    graph, params = nnx.split(sharded)
    local = lambda p, b: jax.lax.psum(labelled_loss_sum(nnx.merge(graph, p), b)[0], "fsdp")
    total = jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P())
    placed = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    loss, grads = jax.jit(jax.value_and_grad(total))(params, placed)

    (ref_loss, _), ref_grads = _loss_and_grad(model, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    nnx.update(sharded, grads)
    got = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                got[(*prefix, *path)] = var.get_value().unshard()
    want = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(ref_grads)}
    assert set(want) <= set(got) and ("head", "embedding") in want
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=str(path))


# ----------------------------------------------------------------- against transformers


def test_labelled_loss_equals_torch_cross_entropy_on_a_transformers_llama(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=False,
        initializer_range=0.3,  # scores of a few units: attention depends on position
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    hf_model.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    # Chunks of 5 tokens: the fused loss's chunking is part of what is compared.
    model = nnx.merge(
        nnx.graphdef(_model(dataclasses.replace(model.config, loss_chunk=5))),
        nnx.state(model),
    )

    def torch_loss(ids, labels):
        with torch.no_grad():
            logits = hf_model(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
        labels = torch.tensor(labels, dtype=torch.long)
        ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        return float(ce), int((labels != -100).sum())

    # Unpacked: two examples of T tokens, one per row; the first 3 tokens of each are the
    # prompt, and the last one has no next token: neither is counted.
    c, d = _ids(T, 3), _ids(T, 4)
    alone = _labelled(*_alone(c, d), counted_from=3)
    per_row = [torch_loss(ids, labels) for ids, labels in zip((c, d), alone["labels"], strict=True)]
    loss, metrics = _loss(model, alone)
    assert int(metrics["tokens"]) == sum(k for _, k in per_row) == 2 * (T - 4)
    np.testing.assert_allclose(float(loss), sum(ce for ce, _ in per_row), rtol=1e-5)
    # Packed with another and padding: the sum of what torch gives each example alone.
    a, b = _ids(A, 1), _ids(B, 2)
    packed = _labelled(*_packed(a, b), counted_from=2)
    per_example = [torch_loss(ids, _labelled(*_alone(ids), 2)["labels"][0]) for ids in (a, b)]
    loss, metrics = _loss(model, packed)
    assert int(metrics["tokens"]) == 2 * sum(k for _, k in per_example)
    np.testing.assert_allclose(float(loss), 2 * sum(ce for ce, _ in per_example), rtol=1e-5)


# -------------------------------------------------------------------------- bad input


def _good_batch():
    tokens, seg, pos = _packed(_ids(A, 1), _ids(B, 2))
    return _labelled(tokens, seg, pos, 1)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda b: b.pop("positions"), ValueError, r"missing \['positions'\]"),
        (lambda b: b.update(weights=b["tokens"]), ValueError, r"unknown \['weights'\]"),
        (
            lambda b: b.update(labels=b["labels"][:, :-1]),
            ValueError,
            r"one shape.*'tokens': \(2, 16\), 'labels': \(2, 15\)",
        ),
        (
            lambda b: b.update(positions=b["positions"].astype(np.float32)),
            TypeError,
            r"batch\['positions'\] must hold integers, got batch\['positions'\].dtype=float32",
        ),
        (
            lambda b: b.update(segment_ids=b["segment_ids"] > 0),
            TypeError,
            r"batch\['segment_ids'\] must hold integers.*bool",
        ),
        (
            lambda b: b.update(labels=b["labels"].reshape(-1)),
            ValueError,
            r"batch\['labels'\] must be \[batch, time\], got batch\['labels'\].shape=\(32,\)",
        ),
        (lambda b: b.update(tokens=None), TypeError, r"batch\['tokens'\] must be an integer"),
    ],
    ids=["missing", "unknown", "shapes", "float", "bool", "rank", "none"],
)
def test_bad_batch_names_the_key_and_shape(change, error, match):
    model = _model(_config())
    batch = _good_batch()
    change(batch)
    with pytest.raises(error, match=match):
        labelled_loss_sum(model, batch)


def test_bad_segment_ids_or_positions_are_named():
    model = _model(_config())
    tokens = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match=r"segment_ids must have the tokens' shape.*\(2, 7\)"):
        model(tokens, segment_ids=np.zeros((2, 7), np.int32))
    with pytest.raises(
        TypeError, match=r"positions must hold integers, got positions\.dtype=float32"
    ):
        model.features(tokens, positions=np.zeros((2, 8), np.float32))
    with pytest.raises(TypeError, match="batch must be a dict"):
        labelled_loss_sum(model, [tokens] * 4)
