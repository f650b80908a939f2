"""The QLoRA path a user writes with the installed library alone, checked several steps later:
from_pretrained(quantize="nf4") -> apply_lora -> a jitted train step (linear_cross_entropy,
optax over the adapters only) -> the loss falls, the base stays as read -> save_adapter ->
peft on the transformers model (its base dequantized, in float64) computes the same logits
-> generate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
from rudax.models import from_pretrained, generate
from tests.models.test_hf_files import _hf


@pytest.mark.standard_promotion  # optax.adamw mixes dtypes in its own code
def test_qlora_trains_saves_and_peft_agrees(tmp_path):
    import peft

    _hf(tie=False).save_pretrained(tmp_path / "base")
    model = from_pretrained(tmp_path / "base", quantize="nf4")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    rl.apply_lora(model, targets, rank=8, alpha=16, rngs=nnx.Rngs(0))
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    base_before = jax.tree.map(np.asarray, rest)
    tx = optax.adamw(1e-1)
    opt_state = tx.init(adapters)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 96, (4, 17)))  # one batch, learned by heart

    def loss_fn(adapters, rest, ids):
        m = nnx.merge(graphdef, adapters, rest)
        h = m.hidden_states(ids[:, :-1])[0]
        table = m.lm_head.embedding[...]
        loss, count = rk.linear_cross_entropy(
            h.reshape(-1, h.shape[-1]), table, ids[:, 1:].reshape(-1), chunk=32
        )
        return loss / count.astype(loss.dtype)

    @jax.jit
    def step(adapters, opt_state, rest, ids):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, rest, ids)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    losses = []
    for _ in range(20):
        adapters, opt_state, loss = step(adapters, opt_state, rest, tokens)
        losses.append(float(loss))
    # A random tiny model's head (std 0.02 over 32 normalized features) keeps its logits
    # within about +-0.5, so even a memorized batch stays near ln(96) = 4.56: a steady fall
    # is what adapters alone can show here.
    assert losses[-1] < losses[0] - 0.1, losses
    # the NF4 base and everything else but the adapters are bit for bit as read
    for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(rest), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    nnx.update(model, adapters)
    rl.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    # peft over the transformers model whose projections are rudax's dequantized NF4 weights
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
                for name in names:
                    node = getattr(getattr(layer, part), name)
                    base = node.base if isinstance(node, rl.LoRALinear) else node
                    w = np.asarray(rk.nf4_dequantize(base.weight, jnp.float32))
                    getattr(getattr(ref.model.layers[i], part), name).weight.copy_(
                        torch.from_numpy(w)
                    )
    tuned = peft.PeftModel.from_pretrained(ref, str(tmp_path / "adapter")).eval()
    ids = rng.integers(0, 96, (2, 9))
    # peft in float64: after 20 steps at lr 0.1 the adapters are large enough that torch's
    # own fp32 forward is 9.3e-6 (relative) off it, rudax's 3.0e-6
    with torch.no_grad():
        want = tuned.double()(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and the tuned model generates through the cache
    out = generate(model, [tokens[0, :5].tolist()], 8, stop_tokens=[])
    assert len(out[0]) == 8
