"""QLoRA with rudax.layers.apply_lora(quantize_base="nf4"): against peft's LoRA on a torch twin
whose Linear weights are the dequantized NF4 weights (CPU, fp32), trained with optax, merged,
saved and loaded as a peft adapter, converted with to_dtype; every refusal before any change.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
from flax import nnx

import rudax.layers as rl
from rudax.kernels import nf4_dequantize, nf4_quantize
from tests.layers import _twins as twins
from tests.layers._random import normal
from tests.layers._twins import Dims, modules_by_name
from tests.layers.test_apply_lora import peft_adapted, set_torch_adapters

# Every Linear's size is a multiple of the 64-block: q, v 256, up, down 512, head 128 weights.
D, H, OUT, LAYERS = 16, 32, 8, 2
X = normal((3, 4, D), 5)
TARGETS = ["q_proj", "v_proj", "down"]
ADAPTED = sorted(f"layers.{i}.{n}" for i in range(LAYERS) for n in ("q_proj", "v_proj", "mlp.down"))
DIMS = Dims(d=D, h=H, out=OUT, layers=LAYERS, norm=False)


TorchNet, Net, Block, twin = twins.at(DIMS)  # the twins at this file's sizes


def dequantized_twin(model):
    """The torch twin whose Linear weights are the rudax model's: each NF4 one dequantized."""
    torch_net = TorchNet()
    with torch.no_grad():
        for name, layer in modules_by_name(model).items():
            if isinstance(layer, rl.NF4Linear):
                t = torch_net.get_submodule(name.removesuffix(".base"))
                t.weight.copy_(torch.from_numpy(np.array(nf4_dequantize(layer.weight))))
    return torch_net


def torch_out(torch_model, x=X):
    with torch.no_grad():
        return torch_model(torch.from_numpy(np.array(x))).numpy()


def qlora_model(quantize_untargeted=False):
    model = twin(TorchNet())
    names = rl.apply_lora(
        model,
        TARGETS,
        rank=2,
        alpha=4.0,
        quantize_base="nf4",
        quantize_untargeted=quantize_untargeted,
        rngs=nnx.Rngs(1),
    )
    assert names == ADAPTED
    return model


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def snapshot(model):
    """Every module's type and every variable's type, dtype and bits, by path."""
    modules = [(p, type(m).__name__) for p, m in nnx.iter_graph(model)]
    variables = [
        (p, type(v).__name__, v.get_value().dtype, _bits(v.get_value()).tobytes())
        for p, v in nnx.to_flat_state(nnx.state(model))
    ]
    return modules, variables


def assert_close_to_torch(got, want):
    # fp32 arithmetic in both, in different orders: rounding relative to the outputs' scale.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


# ---------------------------------------------------------------------------- structure


@pytest.mark.parametrize("untargeted", [False, True])
def test_targets_get_nf4_bases_of_their_own_kernels(untargeted):
    dense = twin(TorchNet())
    model = qlora_model(untargeted)
    mods, dense_mods = modules_by_name(model), modules_by_name(dense)
    for name, layer in mods.items():
        if name in ADAPTED:
            assert type(layer) is rl.LoRALinear and type(layer.base) is rl.NF4Linear, name
            q = nf4_quantize(dense_mods[name].kernel[...].T)
            np.testing.assert_array_equal(layer.base.codes[...], q.codes, err_msg=name)
            np.testing.assert_array_equal(layer.base.absmax_codes[...], q.absmax_codes)
            np.testing.assert_array_equal(
                _bits(layer.base.absmax_scales[...]), _bits(q.absmax_scales)
            )
            assert layer.in_features == dense_mods[name].in_features
        elif name in ("head", "layers.0.mlp.up", "layers.1.mlp.up"):
            assert type(layer) is (rl.NF4Linear if untargeted else type(dense_mods[name])), name
    # Nothing but the adapters is trainable: with every base NF4, LoRAParam is every Param.
    params = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    adapters = {p for p, _ in nnx.to_flat_state(rl.lora_state(model))}
    assert params == adapters if untargeted else params > adapters
    assert len(adapters) == 2 * len(ADAPTED)


def test_nf4_targets_are_wrapped_as_they_are():
    model = nnx.Dict(q_proj=rl.NF4Linear.from_linear(rl.Linear(D, D, rngs=nnx.Rngs(0))))
    base = model["q_proj"]
    before = snapshot(base)
    assert rl.apply_lora(model, ["q_proj"], rank=2, alpha=2.0, rngs=nnx.Rngs(1)) == ["q_proj"]
    assert model["q_proj"].base is base and snapshot(base) == before
    model = nnx.Dict(q_proj=rl.NF4Linear.from_linear(rl.Linear(D, D, rngs=nnx.Rngs(0))))
    base = model["q_proj"]
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=2.0, quantize_base="nf4", rngs=nnx.Rngs(1))
    assert model["q_proj"].base is base  # not quantized twice


# ---------------------------------------------------------------------------- against peft


@pytest.mark.parametrize("untargeted", [False, True])
def test_peft_on_the_dequantized_base_computes_the_same_logits(untargeted):
    model = qlora_model(untargeted)
    peft_model = peft.get_peft_model(
        dequantized_twin(model), peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=TARGETS)
    )
    assert peft_adapted(peft_model) == set(ADAPTED)
    set_torch_adapters(peft_model)  # B non-zero, as after training
    mods = modules_by_name(model)
    for name in ADAPTED:
        t = peft_model.base_model.model.get_submodule(name)
        mods[name].lora_a[...] = jnp.asarray(t.lora_A["default"].weight.detach().numpy().T)
        mods[name].lora_b[...] = jnp.asarray(t.lora_B["default"].weight.detach().numpy().T)
    peft_model.eval()
    assert_close_to_torch(np.asarray(model(X)), torch_out(peft_model))


@pytest.mark.standard_promotion  # optax.adam's moment updates mix dtypes
def test_training_three_steps_moves_the_adapters_only_and_peft_loads_them(tmp_path):
    model = qlora_model(quantize_untargeted=True)
    quantized_before = [
        (p, _bits(v.get_value()).tobytes(), v.get_value().dtype)
        for p, v in nnx.to_flat_state(nnx.state(model, (rl.Quantized, rl.Frozen)))
    ]
    adapters_before = jax.tree.map(np.array, rl.lora_state(model))
    target = normal((*X.shape[:-1], OUT), 9)

    # nnx.grad's and nnx.Optimizer's default wrt (nnx.Param) reach the adapters only: the
    # bases hold no Param.
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum((m(X) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(3):
        loss, grads = train_step(model, optimizer)
        losses.append(float(loss))
    assert {type(v) for _, v in nnx.to_flat_state(grads)} == {rl.LoRAParam}
    assert len(nnx.to_flat_state(grads)) == 2 * len(ADAPTED)
    assert losses[2] < losses[0]

    quantized_after = [
        (p, _bits(v.get_value()).tobytes(), v.get_value().dtype)
        for p, v in nnx.to_flat_state(nnx.state(model, (rl.Quantized, rl.Frozen)))
    ]
    assert quantized_after == quantized_before  # codes, absmax, biases: bit for bit
    assert any(p[-1] == "codes" for p, _, _ in quantized_after)
    for (path, before), (_, after) in zip(
        nnx.to_flat_state(adapters_before), nnx.to_flat_state(rl.lora_state(model)), strict=True
    ):
        assert not np.array_equal(before.get_value(), after.get_value()), path

    # The adapter file, unchanged by the NF4 bases, loads in peft on the dequantized twin.
    assert rl.save_adapter(model, tmp_path, base_model_name_or_path=None, task_type=None) == ADAPTED
    loaded = peft.PeftModel.from_pretrained(dequantized_twin(model), str(tmp_path))
    loaded.eval()
    assert_close_to_torch(np.asarray(model(X)), torch_out(loaded))

    # And back into rudax: a bare model whose layers are NF4 already, then one with QLoRA.
    bare = twin(TorchNet())
    for block in bare.layers:
        block.q_proj = rl.NF4Linear.from_linear(block.q_proj)
        block.v_proj = rl.NF4Linear.from_linear(block.v_proj)
        for key in ("up", "down"):
            block.mlp[key] = rl.NF4Linear.from_linear(block.mlp[key])
    bare.head = rl.NF4Linear.from_linear(bare.head)
    assert rl.load_adapter(bare, tmp_path) == ADAPTED
    np.testing.assert_array_equal(np.asarray(bare(X)), np.asarray(model(X)))
    again = qlora_model(quantize_untargeted=True)
    assert rl.load_adapter(again, tmp_path) == ADAPTED
    np.testing.assert_array_equal(np.asarray(again(X)), np.asarray(model(X)))


# ---------------------------------------------------------------------------- merge, to_dtype


def test_merge_lora_gives_dense_layers_of_dequantized_weight_plus_update():
    model = qlora_model()
    mods = modules_by_name(model)
    for i, name in enumerate(ADAPTED):
        mods[name].lora_b[...] = normal(mods[name].lora_b.shape, 20 + i)
    expected = {}
    for name in ADAPTED:
        lora = mods[name]
        w = np.asarray(nf4_dequantize(lora.base.weight, jnp.float32), np.float64)
        a, b = (np.asarray(v[...], np.float64) for v in (lora.lora_a, lora.lora_b))
        expected[name] = w.T + lora.scale * a @ b
    y = np.asarray(model(X))
    assert rl.merge_lora(model) == ADAPTED
    mods = modules_by_name(model)
    for name, kernel in expected.items():
        layer = mods[name]
        assert type(layer) is rl.Linear and type(layer.kernel) is nnx.Param, name
        assert layer.kernel[...].dtype == jnp.float32 and layer.dtype is None
        # fp32 sum of the dequantized weight and an fp32 product of rank 2: a few ulps.
        np.testing.assert_allclose(layer.kernel[...], kernel, rtol=2e-7, atol=1e-7, err_msg=name)
        assert (layer.bias is None) == name.endswith("v_proj")
        if layer.bias is not None:
            assert type(layer.bias) is nnx.Param
    np.testing.assert_allclose(np.asarray(model(X)), y, rtol=1e-5, atol=1e-5)


def test_merge_keeps_the_original_weight_dtype():
    lin = rl.Linear(D, D, param_dtype=jnp.bfloat16, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model = nnx.Dict(q_proj=lin)
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=2.0, quantize_base="nf4", rngs=nnx.Rngs(1))
    base = model["q_proj"].base
    assert rl.merge_lora(model) == ["q_proj"]
    merged = model["q_proj"]
    assert merged.kernel[...].dtype == jnp.bfloat16 and merged.bias[...].dtype == jnp.bfloat16
    assert merged.dtype == jnp.float32
    # B = 0: the merged kernel is the dequantized weight, rounded to bf16 once.
    np.testing.assert_array_equal(
        _bits(merged.kernel[...]), _bits(nf4_dequantize(base.weight, jnp.bfloat16).T)
    )


def test_to_dtype_leaves_nf4_storage_alone():
    model = qlora_model(quantize_untargeted=True)
    quantized = [
        (p, v.get_value().dtype, _bits(v.get_value()).tobytes())
        for p, v in nnx.to_flat_state(nnx.state(model, rl.Quantized))
    ]
    assert {dt for _, dt, _ in quantized} == {jnp.dtype(jnp.uint8), jnp.dtype(jnp.float32)}
    rl.to_dtype(model, jnp.bfloat16)
    after = [
        (p, v.get_value().dtype, _bits(v.get_value()).tobytes())
        for p, v in nnx.to_flat_state(nnx.state(model, rl.Quantized))
    ]
    assert after == quantized
    assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(model, rl.Frozen))} == {
        jnp.dtype(jnp.bfloat16)  # the biases
    }
    lora = {v.get_value().dtype for _, v in nnx.to_flat_state(rl.lora_state(model))}
    assert lora == {jnp.dtype(jnp.bfloat16)}
    rl.to_dtype(model, jnp.float32, only=rl.LoRAParam)
    lora = {v.get_value().dtype for _, v in nnx.to_flat_state(rl.lora_state(model))}
    assert lora == {jnp.dtype(jnp.float32)}
    assert model(X.astype(jnp.bfloat16)).dtype == jnp.bfloat16


# ---------------------------------------------------------------------------- refusals


def _odd_model():
    """q_proj quantizes; odd (6 x 6 = 36 weights) cannot be cut into 64-blocks."""
    rngs = nnx.Rngs(0)
    return nnx.Dict(q_proj=rl.Linear(D, D, rngs=rngs), odd=rl.Linear(6, 6, rngs=rngs))


def _tied_model():
    rngs = nnx.Rngs(0)
    model = nnx.Dict(q_proj=rl.Linear(D, D, rngs=rngs), k_proj=rl.Linear(D, D, rngs=rngs))
    model["k_proj"].kernel = model["q_proj"].kernel
    model["o_proj"] = rl.Linear(D, D, rngs=rngs)
    return model


@pytest.mark.parametrize(
    "make, kwargs, error, match",
    [
        (
            qlora_model,
            dict(quantize_base="int8"),
            ValueError,
            r"quantize_base must be None or 'nf4', got quantize_base='int8'",
        ),
        (qlora_model, dict(quantize_base=True), ValueError, r"quantize_base=True"),
        (
            qlora_model,
            dict(quantize_untargeted=True),
            ValueError,
            r"quantize_untargeted=True needs a format: pass quantize_base='nf4'",
        ),
        (
            qlora_model,
            dict(quantize_base="nf4", quantize_untargeted=1),
            TypeError,
            r"quantize_untargeted must be a bool",
        ),
        (
            _odd_model,
            dict(targets=["q_proj", "odd"], quantize_base="nf4"),
            ValueError,
            r"quantize_base='nf4': 'odd': Linear of kernel shape \[in, out\]=\(6, 6\) has 36 "
            r"weights",
        ),
        (
            _odd_model,
            dict(targets=["q_proj"], quantize_base="nf4", quantize_untargeted=True),
            ValueError,
            r"'odd': Linear of kernel shape \[in, out\]=\(6, 6\)",
        ),
        (
            _tied_model,
            dict(targets=["o_proj"], quantize_base="nf4", quantize_untargeted=True),
            ValueError,
            r"quantize_untargeted: the Linear at \.(k|q)_proj has a variable tied to "
            r"\['\.(q|k)_proj\.kernel'\]",
        ),
    ],
    ids=[
        "int8",
        "bool",
        "untargeted-alone",
        "untargeted-int",
        "odd-target",
        "odd-untargeted",
        "tied",
    ],
)
def test_refusals_name_the_argument_and_change_nothing(make, kwargs, error, match):
    model = twin(TorchNet()) if make is qlora_model else make()
    before = snapshot(model)
    kwargs = dict(targets=TARGETS) | kwargs
    with pytest.raises(error, match=match):
        rl.apply_lora(model, kwargs.pop("targets"), rank=2, alpha=4.0, rngs=nnx.Rngs(1), **kwargs)
    assert snapshot(model) == before
