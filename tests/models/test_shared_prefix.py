"""Shared-prefix rows (``pack_shared_prefix`` + ``branch_ids``) against the unshared layout.

The unshared layout is today's packing: each completion as its own example ``prompt +
completion``, a segment of one row, its labels the next tokens of the completion. The shared
rows must give every completion token the same logits (within fp32 rounding), the same loss
sum and count, and the whole model the same gradients (the shared prompt's gradient being
the sum of its copies'): dense with GQA and a sliding window, LoRA, QLoRA, a Mixtral, and
scanned layers under remat.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from rudax.models import (
    IGNORE_INDEX,
    LlamaConfig,
    LlamaForCausalLM,
    causal_lm_loss_sum,
    pack_shared_prefix,
)

V = 64
# Two examples of one row: a 9-token prompt with three completions, a 1-token prompt with two.
EXAMPLES = [
    ([3, 14, 15, 9, 26, 5, 35, 8, 9], [[7, 9, 3, 2], [38, 4, 6, 2, 6, 4], [33]]),
    ([27], [[18, 28, 1, 8, 2], [8, 4]]),
]


def _unshared(examples):
    """Each completion its own segment ``prompt + completion`` in one row, labels shifted."""
    tokens, labels, segments, positions = [], [], [], []
    for prompt, completions in examples:
        for c in completions:
            seq = list(prompt) + list(c)
            tokens += seq
            labels += [IGNORE_INDEX] * (len(prompt) - 1) + list(c) + [IGNORE_INDEX]
            segments += [len(set(segments)) + 1] * len(seq)
            positions += range(len(seq))
    row = lambda x: np.asarray([x], np.int32)
    return {
        "tokens": row(tokens),
        "labels": row(labels),
        "segment_ids": row(segments),
        "positions": row(positions),
    }


def _config(**kw):
    base = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaConfig(**{**base, **kw})


def _randomize_lora(model):
    """LoRA's B starts at 0 (no gradient reaches A): draw both, so both are tested."""
    state = nnx.state(model, rl.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    drawn = [
        0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, drawn))


def _model(kind):
    if kind == "mixtral":
        return LlamaForCausalLM(
            _config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
            rngs=nnx.Rngs(0),
        )
    if kind == "window":  # Mistral: each query sees itself and 3 keys before it
        return LlamaForCausalLM(_config(sliding_window=4), rngs=nnx.Rngs(0))
    model = LlamaForCausalLM(_config(), rngs=nnx.Rngs(0))
    if kind in ("lora", "qlora"):
        quantize = "nf4" if kind == "qlora" else None
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        rl.apply_lora(model, targets, rank=4, alpha=8, quantize_base=quantize, rngs=nnx.Rngs(1))
        _randomize_lora(model)
    if kind == "scan-remat":
        model.scan_layers = True
        model.remat = "full"
    return model


def _loss_and_grads(model, batch, trained):
    graphdef, params, rest = nnx.split(model, trained, ...)

    @jax.jit
    def run(params, rest, batch):
        def loss(params):
            total, metrics = causal_lm_loss_sum(nnx.merge(graphdef, params, rest), batch)
            return total, metrics

        (total, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return total, metrics["tokens"], grads

    return run(params, rest, {k: jnp.asarray(v) for k, v in batch.items()})


@pytest.mark.parametrize("kind", ["dense", "window", "lora", "qlora", "mixtral", "scan-remat"])
def test_shared_rows_equal_the_unshared_layout(kind):
    model = _model(kind)
    shared = pack_shared_prefix(EXAMPLES, row_length=32)
    unshared = _unshared(EXAMPLES)
    assert (shared.segment_ids != 0).sum() == 31 < unshared["tokens"].size == 47
    assert shared.num_tokens == int((unshared["labels"] != IGNORE_INDEX).sum()) == 18

    # Logits at every labelled position, in the same order in both layouts.
    def labelled_logits(batch):
        logits = model(
            jnp.asarray(batch["tokens"]),
            **{k: jnp.asarray(v) for k, v in batch.items() if k not in ("tokens", "labels")},
        )
        return np.asarray(logits)[np.asarray(batch["labels"]) != IGNORE_INDEX]

    got, want = labelled_logits(shared.batch()), labelled_logits(unshared)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())

    trained = rl.LoRAParam if kind in ("lora", "qlora") else nnx.Param
    loss_s, count_s, grads_s = _loss_and_grads(model, shared.batch(), trained)
    loss_u, count_u, grads_u = _loss_and_grads(model, unshared, trained)
    assert int(count_s) == int(count_u) == 18
    np.testing.assert_allclose(float(loss_s), float(loss_u), rtol=2e-6)
    flat_s = jax.tree_util.tree_leaves_with_path(grads_s)
    flat_u = jax.tree.leaves(grads_u)
    assert len(flat_s) == len(flat_u) > 0
    for (path, a), b in zip(flat_s, flat_u, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.abs(b).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            a, b, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )


def test_changing_one_completion_leaves_the_others_unchanged():
    """Another completion's tokens change no bit of a completion's logits."""
    model = _model("dense")
    rows = pack_shared_prefix(EXAMPLES)
    other = [(EXAMPLES[0][0], [EXAMPLES[0][1][0], [5, 5, 5, 5, 5, 5], EXAMPLES[0][1][2]])]
    rows2 = pack_shared_prefix(other + EXAMPLES[1:])

    def logits(r):
        b = {k: jnp.asarray(v) for k, v in r.batch().items() if k != "labels"}
        return np.asarray(model(b.pop("tokens"), **b))

    a, b = logits(rows), logits(rows2)
    first = (rows.branch_ids == 1) & (rows.segment_ids == 1)
    np.testing.assert_array_equal(a[first], b[first])
    second = (rows.branch_ids == 2) & (rows.segment_ids == 1)
    assert not np.array_equal(a[second], b[second])


def test_packing_layout():
    rows = pack_shared_prefix([([5, 6, 7], [[8, 9], [10]]), ([1], [[2, 3]])], row_length=8)
    assert rows.tokens.tolist() == [[5, 6, 7, 8, 9, 7, 10, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert rows.labels.tolist() == [
        [-100, -100, 8, 9, -100, 10, -100, -100],
        [2, 3, -100, -100, -100, -100, -100, -100],
    ]
    assert rows.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert rows.branch_ids.tolist() == [[0, 0, 1, 1, 1, 2, 2, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert rows.completion.tolist() == [
        [-1, -1, 0, 0, -1, 1, -1, -1],
        [2, 2, -1, -1, -1, -1, -1, -1],
    ]
    assert rows.num_tokens == 5


@pytest.mark.parametrize(
    ("examples", "kwargs", "error", "match"),
    [
        ([], {}, TypeError, "non-empty sequence"),
        ([([1, 2], [])], {}, ValueError, r"examples\[0\] has no completion"),
        ([([], [[1]])], {}, ValueError, r"examples\[0\]\[0\] \(the prompt\) must hold at least"),
        ([([1], [[2], []])], {}, ValueError, r"examples\[0\]\[1\]\[1\] must hold at least one"),
        ([([1, 2.0], [[3]])], {}, TypeError, r"examples\[0\]\[0\] \(the prompt\)\[1\] .* 2.0"),
        ([([1, True], [[3]])], {}, TypeError, r"must be an int token id, got True"),
        ([([1], [[-3]])], {}, ValueError, r"examples\[0\]\[1\]\[0\]\[0\] must be a token id >= 0"),
        ([([1, 2, 3], [[4, 5]])], {"row_length": 4}, ValueError, r"takes 5 tokens shared"),
        ([([1], [[2]])], {"row_length": 0}, ValueError, "row_length must be None or an int"),
        ([([1], [[2]])], {"pad_id": -1}, ValueError, "pad_id must be a token id >= 0"),
        ([(np.array([1.0]), [[2]])], {}, TypeError, "must hold integer token ids"),
    ],
)
def test_bad_examples_are_named(examples, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack_shared_prefix(examples, **kwargs)
