"""causal_lm_loss_sum against torch's cross entropy on transformers' logits of the same weights,
its packed-row contract, and LlamaForCausalLM's remat and scan_layers (same loss and
gradients as the plain loop)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import rudax.layers as rl
from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss_sum, from_pretrained
from tests.models.test_hf_files import V, _hf


def _batch(rng, b=3, t=12):
    tokens = rng.integers(0, V, (b, t))
    labels = np.where(rng.random((b, t)) < 0.6, rng.integers(0, V, (b, t)), -100)
    return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}


def test_loss_is_torch_cross_entropy_summed_over_transformers_logits(tmp_path):
    hf = _hf(tie=False)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    batch = _batch(np.random.default_rng(0))
    loss, metrics = causal_lm_loss_sum(model, batch, chunk=5)  # chunks cross rows
    with torch.no_grad():
        logits = hf(torch.tensor(np.asarray(batch["tokens"]), dtype=torch.long)).logits
    labels = torch.tensor(np.asarray(batch["labels"]), dtype=torch.long)
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, V).double(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    assert int(metrics["tokens"]) == int((labels != -100).sum())
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert float(metrics["ce_sum"]) == float(loss)


def _tiny(**kw):
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0), **kw)


def test_packed_row_is_the_sum_of_its_examples_alone():
    model = _tiny()
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, V, 5), rng.integers(0, V, 4)
    la, lb = rng.integers(0, V, 5), rng.integers(0, V, 4)
    la[0] = lb[0] = -100
    packed = {
        "tokens": jnp.asarray([np.concatenate([a, b, [0, 0]])]),
        "labels": jnp.asarray([np.concatenate([la, lb, [-100, -100]])]),
        "segment_ids": jnp.asarray([[1] * 5 + [2] * 4 + [0, 0]]),
        "positions": jnp.asarray([list(range(5)) + list(range(4)) + [0, 0]]),
    }
    alone = [
        causal_lm_loss_sum(model, {"tokens": jnp.asarray([x]), "labels": jnp.asarray([y])})[0]
        for x, y in ((a, la), (b, lb))
    ]
    loss, metrics = causal_lm_loss_sum(model, packed)
    assert int(metrics["tokens"]) == 7
    np.testing.assert_allclose(float(loss), float(alone[0] + alone[1]), rtol=1e-6)


def test_nothing_counted_is_zero_with_zero_gradients():
    model = _tiny()
    batch = {"tokens": jnp.ones((2, 4), jnp.int32), "labels": jnp.full((2, 4), -100)}
    loss, grads = nnx.value_and_grad(lambda m: causal_lm_loss_sum(m, batch)[0])(model)
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ([1, 2], TypeError, "batch must be a dict"),
        ({"tokens": jnp.ones((1, 3), int)}, ValueError, r"missing \['labels'\]"),
        (
            {"tokens": jnp.ones((1, 3), int), "labels": jnp.ones((1, 3), int), "mask": 1},
            ValueError,
            r"unknown \['mask'\]",
        ),
        (
            {"tokens": jnp.ones((1, 3)), "labels": jnp.ones((1, 3), int)},
            TypeError,
            r"batch\['tokens'\] must hold integers",
        ),
        (
            {"tokens": jnp.ones((3,), int), "labels": jnp.ones((3,), int)},
            ValueError,
            r"batch\['tokens'\] must be \[batch, time\]",
        ),
        (
            {"tokens": jnp.ones((1, 3), int), "labels": jnp.ones((1, 4), int)},
            ValueError,
            "one shape",
        ),
    ],
)
def test_bad_batches_name_the_key(batch, error, match):
    with pytest.raises(error, match=match):
        causal_lm_loss_sum(_tiny(), batch)


def test_bad_chunk_and_model():
    batch = {"tokens": jnp.ones((1, 3), int), "labels": jnp.ones((1, 3), int)}
    with pytest.raises(ValueError, match="chunk must be a positive int, got 0"):
        causal_lm_loss_sum(_tiny(), batch, chunk=0)
    with pytest.raises(TypeError, match=r"model must be a rudax\.models\.LlamaForCausalLM"):
        causal_lm_loss_sum(object(), batch)  # type: ignore[arg-type]


def _loss_and_grads(model, batch):
    return nnx.value_and_grad(lambda m: causal_lm_loss_sum(m, batch)[0])(model)


@pytest.mark.parametrize(("remat", "scan"), [("full", False), ("none", True), ("full", True)])
def test_remat_and_scan_give_the_plain_loss_and_gradients(remat, scan):
    batch = _batch(np.random.default_rng(2))
    want_loss, want = _loss_and_grads(_tiny(), batch)
    model = _tiny(remat=remat, scan_layers=scan)
    loss, grads = _loss_and_grads(model, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    # A scan's loop body lays the weight-gradient matmuls out differently from the unrolled
    # program (another summation order): within 16 fp32 ulps of each leaf's largest element,
    # the bound of tests/lm/test_scan_layers.py.
    ulps = 16 * float(jnp.finfo(jnp.float32).eps)
    got = dict(nnx.to_flat_state(grads))
    for path, w in nnx.to_flat_state(want):
        if scan and path[:2] == ("model", "layers"):  # stored stacked: layer i is slice i
            g = got[(*path[:2], *path[3:])][path[2]]
        else:
            g = got[path]
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.max(np.abs(g - w)) <= ulps * np.max(np.abs(w)), path
    # scanned, the layers are stored stacked: no copy of them per step
    q = model.model.layers[0].self_attn.q_proj if not scan else model.model.layers.self_attn.q_proj
    assert q.kernel.shape == ((3, 32, 32) if scan else (32, 32))


def test_scan_layers_refuses_dropout_and_bad_options(tmp_path):
    model = _tiny()
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4, dropout=0.1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layers\[0\] holds RNG state \(dropout\)"):
        model.scan_layers = True
    assert not model.scan_layers  # refused before anything changed: it runs as a loop
    assert np.isfinite(float(causal_lm_loss_sum(model, _batch(np.random.default_rng(3)))[0]))
    stacked = _tiny(scan_layers=True)
    with pytest.raises(ValueError, match=r"model\.layers holds 3 layers stored stacked"):
        rl.apply_lora(stacked, ["q_proj"], rank=2, alpha=4, rngs=nnx.Rngs(0))
    # LoRA put on first, then stacked: merging, saving and loading adapters are refused too
    adapted = _tiny()
    rl.apply_lora(adapted, ["q_proj"], rank=2, alpha=4, rngs=nnx.Rngs(0))
    rl.save_adapter(adapted, tmp_path, base_model_name_or_path="tiny")
    adapted.scan_layers = True
    for refused in (
        lambda: rl.merge_lora(adapted),
        lambda: rl.save_adapter(adapted, tmp_path / "b", base_model_name_or_path="tiny"),
        lambda: rl.load_adapter(adapted, tmp_path),
    ):
        with pytest.raises(ValueError, match="stored stacked"):
            refused()
    with pytest.raises(ValueError, match="remat must be one of"):
        _tiny(remat="some")
    with pytest.raises(TypeError, match="scan_layers must be a bool"):
        _tiny(scan_layers=1)
