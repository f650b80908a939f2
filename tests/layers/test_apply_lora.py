"""rudax.layers.apply_lora, merge_lora, lora_state against peft's LoRA on a torch twin (CPU, fp32).

The twin is a small torch model with Linear children named like an LLM's (q_proj, v_proj, an
mlp of up and down, a LayerNorm) in a ModuleList, and the same model in nnx with the same
weights: peft's choices (which layers a target spec adapts, the adapted outputs, the merged
weights) are the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
from flax import nnx
from peft.tuners.lora import LoraLayer
from torch import nn

import rudax.layers as rl
from tests.layers import _twins as twins
from tests.layers._random import normal
from tests.layers._twins import Dims, modules_by_name
from tests.optim._bad_input import rejects

D, H, OUT, LAYERS = 8, 12, 5, 2
DIMS = Dims(d=D, h=H, out=OUT, layers=LAYERS, norm=True)


TorchNet, Net, Block, twin = twins.at(DIMS)  # the twins at this file's sizes


def peft_adapted(peft_model):
    """The names of the modules peft put a LoRA layer on."""
    return {n for n, m in peft_model.base_model.model.named_modules() if isinstance(m, LoraLayer)}


def set_torch_adapters(peft_model, seed=1):
    """Random A and B (B non-zero, as after training) on every adapted torch layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in peft_model.modules():
            if isinstance(m, LoraLayer):
                for lin in (m.lora_A["default"], m.lora_B["default"]):
                    lin.weight.copy_(0.3 * torch.randn(lin.weight.shape, generator=g))


def copy_adapters(peft_model, model):
    """peft's A [r, in] and B [out, r] into the rudax LoRALinear at the same name."""
    mods = modules_by_name(model)
    for name in peft_adapted(peft_model):
        t = peft_model.base_model.model.get_submodule(name)
        mods[name].lora_a[...] = jnp.asarray(t.lora_A["default"].weight.detach().numpy().T)
        mods[name].lora_b[...] = jnp.asarray(t.lora_B["default"].weight.detach().numpy().T)


def torch_out(torch_model, x):
    with torch.no_grad():
        return torch_model(torch.from_numpy(np.array(x))).numpy()


X = normal((3, 4, D), 5)

# ---------------------------------------------------------------------------- matching


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "v_proj"],
        ["up"],  # a suffix after a dot: layers.i.mlp.up
        ["mlp.down", "layers.1.q_proj"],  # several components, and one whole name
        ("head",),
        r".*_proj",  # a regex must match the whole name
        r"layers\.1\.(q_proj|mlp\.up)",
        ["proj"],  # not a dot-separated suffix: no match
        "q_proj",  # a str is a regex: fullmatch of "q_proj" fails on layers.0.q_proj
        ["norm"],  # a LayerNorm: not adaptable
        r"layers\.0\..*",  # the LayerNorm and the ModuleDict too: refused
    ],
)
def test_targets_match_what_peft_matches(targets):
    try:
        expected = peft_adapted(
            peft.get_peft_model(TorchNet(), peft.LoraConfig(r=2, target_modules=targets))
        )
    except ValueError:
        expected = None
    model = Net(nnx.Rngs(0))
    if expected is None:
        with pytest.raises((ValueError, TypeError), match=r"targets="):
            rl.apply_lora(model, targets, rank=2, alpha=8.0, rngs=nnx.Rngs(1))
        assert not any(isinstance(m, rl.LoRALinear) for m in modules_by_name(model).values())
    else:
        names = rl.apply_lora(model, targets, rank=2, alpha=8.0, rngs=nnx.Rngs(1))
        assert names == sorted(expected)
        adapted = {n for n, m in modules_by_name(model).items() if isinstance(m, rl.LoRALinear)}
        assert adapted == expected


# ---------------------------------------------------------------------------- outputs, merge


@pytest.mark.parametrize("use_rslora", [False, True], ids=["alpha/rank", "rslora"])
def test_outputs_equal_peft_for_the_same_adapters(use_rslora):
    targets = ["q_proj", "v_proj", "up"]
    torch_net = TorchNet()
    model = twin(torch_net)
    np.testing.assert_allclose(model(X), torch_out(torch_net, X), rtol=1e-5, atol=1e-5)
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets, use_rslora=use_rslora)
    peft_model = peft.get_peft_model(torch_net, config)
    set_torch_adapters(peft_model)
    rule = "alpha/sqrt(rank)" if use_rslora else "alpha/rank"
    names = rl.apply_lora(model, targets, rank=4, alpha=6.0, scale_rule=rule, rngs=nnx.Rngs(1))
    assert len(names) == 3 * LAYERS
    copy_adapters(peft_model, model)
    expected = torch_out(peft_model, X)
    assert np.abs(expected - torch_out(TorchNet(), X)).max() > 0.1  # the adapters matter
    np.testing.assert_allclose(model(X), expected, rtol=1e-5, atol=1e-5)
    # The same under jit, through the functional split.
    graphdef, state = nnx.split(model)
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, X)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_merge_lora_equals_peft_merge_and_unload():
    targets = ["q_proj", "v_proj", "down"]
    torch_net = TorchNet()
    model = twin(torch_net)
    peft_model = peft.get_peft_model(
        torch_net, peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets)
    )
    set_torch_adapters(peft_model)
    rl.apply_lora(model, targets, rank=3, alpha=5.0, rngs=nnx.Rngs(1))
    copy_adapters(peft_model, model)
    before = np.asarray(model(X))
    adapted = sorted(peft_adapted(peft_model))
    merged_torch = peft_model.merge_and_unload()
    assert rl.merge_lora(model) == adapted
    mods = modules_by_name(model)
    for name, t in merged_torch.named_modules():
        if isinstance(t, nn.Linear):
            m = mods[name]
            assert type(m) is not rl.LoRALinear and type(m.kernel) is nnx.Param
            np.testing.assert_allclose(
                np.asarray(m.kernel[...]), t.weight.detach().numpy().T, rtol=1e-6, atol=1e-6
            )
            if m.bias is not None:
                assert type(m.bias) is nnx.Param
    assert not jax.tree.leaves(rl.lora_state(model))
    np.testing.assert_allclose(model(X), torch_out(merged_torch, X), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model(X), before, rtol=1e-5, atol=1e-5)


def test_merge_rounds_once_to_the_kernel_dtype():
    model = nnx.Dict(proj=rl.Linear(6, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    rl.apply_lora(model, ["proj"], rank=2, alpha=2.0, rngs=nnx.Rngs(1))
    lora = model["proj"]
    lora.lora_b[...] = normal((2, 4), 3)
    f32 = lambda v: np.asarray(v[...], np.float32)
    exact = f32(lora.base.kernel) + 1.0 * f32(lora.lora_a) @ f32(lora.lora_b)
    rl.merge_lora(model)
    kernel = model["proj"].kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kernel, jnp.asarray(exact).astype(jnp.bfloat16))


def test_merge_replaces_a_shared_lora_layer_at_every_path():
    lora = rl.LoRALinear(rl.Linear(4, 4, rngs=nnx.Rngs(0)), 2, alpha=2.0, rngs=nnx.Rngs(1))
    model = nnx.Dict(a=lora, b=lora)
    assert rl.merge_lora(model) == ["a"]
    assert model["a"] is model["b"] and type(model["a"]) is rl.Linear


# ---------------------------------------------------------------------------- state, split


def test_lora_state_and_split_select_exactly_the_adapters():
    model = Net(nnx.Rngs(0))
    names = rl.apply_lora(model, ["q_proj", "up"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    paths = sorted(".".join(map(str, p)) for p, v in nnx.to_flat_state(rl.lora_state(model)))
    assert paths == sorted(f"{n}.{ab}" for n in names for ab in ("lora_a", "lora_b"))
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    assert all(type(v) is rl.LoRAParam for _, v in nnx.to_flat_state(adapters))
    assert len(nnx.to_flat_state(adapters)) == 2 * len(names)
    assert not any(isinstance(v, rl.LoRAParam) for _, v in nnx.to_flat_state(rest))
    # nnx.Param also selects the norms and the unadapted layers: LoRAParam is the narrower filter.
    assert len(nnx.to_flat_state(nnx.state(model, nnx.Param))) > 2 * len(names)

    # One functional optax step on the adapters: only they move.
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(X) ** 2)
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    tx = optax.sgd(0.1)
    grads = jax.jit(jax.grad(loss))(adapters)
    updates, _ = tx.update(grads, tx.init(adapters), adapters)
    nnx.update(model, optax.apply_updates(adapters, updates))
    for p, v in nnx.to_flat_state(nnx.state(model)):
        moved = not np.array_equal(before[p], np.asarray(v.get_value()))
        # B starts at zero, so A's gradient is zero on the first step: B moves, A does not.
        assert moved == (p[-1] == "lora_b"), p


def test_names_map_paths_to_another_layout():
    """The model's paths differ from the names; a None name is not adaptable."""
    model = nnx.Dict(blocks=nnx.List([Block(nnx.Rngs(0)), Block(nnx.Rngs(1))]))

    def names(path):
        if path[:1] != ("blocks",) or path[-1:] == ("v_proj",):
            return None
        return ".".join(map(str, ("model.layers", *path[1:])))

    got = rl.apply_lora(
        model, ["q_proj", "v_proj"], rank=2, alpha=4.0, names=names, rngs=nnx.Rngs(2)
    )
    assert got == ["model.layers.0.q_proj", "model.layers.1.q_proj"]
    assert type(model["blocks"][1].q_proj) is rl.LoRALinear
    assert type(model["blocks"][1].v_proj) is nnx.Linear  # no name: left alone
    assert rl.merge_lora(model, names=names) == got


def test_finds_layers_in_sequential_and_in_plain_lists_marked_data():
    rngs = nnx.Rngs(0)

    class Holder(nnx.Module):
        def __init__(self):
            self.seq = nnx.Sequential(rl.Linear(4, 4, rngs=rngs), jax.nn.relu)
            self.plain = nnx.data([rl.Linear(4, 4, rngs=rngs)])

    model = Holder()
    got = rl.apply_lora(model, r"seq\.layers\.0|plain\.0", rank=2, alpha=2.0, rngs=rngs)
    assert got == ["plain.0", "seq.layers.0"]
    assert type(model.seq.layers[0]) is rl.LoRALinear and type(model.plain[0]) is rl.LoRALinear
    assert rl.merge_lora(model) == got
    assert type(model.seq.layers[0]) is rl.Linear and type(model.plain[0]) is rl.Linear


def test_to_dtype_bf16_base_with_fp32_adapters():
    model = nnx.Dict(
        q_proj=rl.Linear(D, D, rngs=nnx.Rngs(0)), v_proj=nnx.Linear(D, D, rngs=nnx.Rngs(0))
    )
    rl.apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    # Every floating variable by default, the adapters included (they are nnx.Params) ...
    rl.to_dtype(model, jnp.bfloat16)
    types = {p: type(v) for p, v in nnx.to_flat_state(nnx.state(model))}
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model))} == {bf16}
    # ... and with only=, a bf16 base under fp32 adapters; every variable keeps its type.
    rl.to_dtype(model, jnp.float32, only=rl.LoRAParam)
    assert {p: type(v) for p, v in nnx.to_flat_state(nnx.state(model))} == types
    dtypes = {type(v): v.dtype for _, v in nnx.to_flat_state(nnx.state(model))}
    assert dtypes == {rl.LoRAParam: f32, rl.Frozen: bf16}
    lora = model["q_proj"]
    lora.lora_b[...] = normal((2, D), 3)
    assert lora.lora_b.dtype == f32
    f64 = lambda v: np.asarray(np.asarray(v[...], np.float32), np.float64)
    x = np.asarray(X[0], np.float64)
    expected = (
        x @ f64(lora.base.kernel)
        + f64(lora.base.bias)
        + 2.0 * x @ f64(lora.lora_a) @ f64(lora.lora_b)
    )
    y = lora(X[0])  # computes in the input's fp32 from the bf16-stored base
    assert y.dtype == f32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- bad input


def _apply(**kwargs):
    return rl.apply_lora(Net(nnx.Rngs(0)), **kwargs)


test_bad_arguments = rejects(
    _apply,
    [
        ({"targets": 3}, TypeError, r"targets must be a list of module names .* targets=3"),
        ({"targets": []}, ValueError, r"targets must name at least one module, got targets=\[\]"),
        ({"targets": ["q_proj", ""]}, ValueError, r"non-empty module names, got '' in targets="),
        ({"targets": ["q_proj", 1]}, TypeError, r"str module names, got 1 in targets="),
        ({"targets": "(["}, ValueError, r"not a valid regular expression .* targets='\(\['"),
        ({"targets": "all-linear"}, ValueError, r"targets='all-linear' is peft's shorthand"),
        (
            {"targets": ["k_proj"]},
            ValueError,
            r"targets=\['k_proj'\] matches no module.*'head', 'layers\.0\.mlp\.down'",
        ),
        (
            {"targets": ["norm", "q_proj"]},
            TypeError,
            r"not a rudax\.layers\.Linear or flax\.nnx\.Linear: \['layers\.0\.norm \(LayerNorm\)'",
        ),
        ({"rank": 0}, ValueError, r"rank=0"),
        ({"alpha": 0.0}, ValueError, r"alpha=0\.0"),
        ({"scale_rule": "rslora"}, ValueError, r"scale_rule='rslora'"),
        ({"param_dtype": jnp.int8}, TypeError, r"param_dtype="),
        ({"rngs": None}, TypeError, r"rngs must be an nnx\.Rngs, got NoneType"),
        ({"names": "layers"}, TypeError, r"names must be a callable"),
        ({"names": lambda p: 1}, TypeError, r"names must return a str or None, got 1"),
        ({"names": lambda p: "x"}, ValueError, r"two modules the same name 'x'"),
    ],
    targets=["q_proj"],
    rank=2,
    alpha=4.0,
    rngs=nnx.Rngs(1),
)


def test_an_error_leaves_the_model_unchanged():
    model = Net(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    for kwargs in ({"rank": 0}, {"targets": ["q_proj", "norm"]}):
        with pytest.raises((ValueError, TypeError)):
            rl.apply_lora(
                model,
                **{"targets": ["q_proj"], "rank": 2, "alpha": 1.0, **kwargs},
                rngs=nnx.Rngs(1),
            )
        assert not any(isinstance(m, rl.LoRALinear) for m in modules_by_name(model).values())
        assert all(type(v) is nnx.Param for _, v in nnx.to_flat_state(nnx.state(model)))
        jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)


def test_refuses_an_adapted_layer_a_shared_layer_and_a_tied_kernel():
    model = Net(nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"already have LoRA: \['layers\.0\.q_proj', 'layers\.1"):
        rl.apply_lora(model, r".*_proj", rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    # Its insides (the base, the dropout) are not candidates: nothing to match by their names.
    with pytest.raises(ValueError, match=r"matches no module"):
        rl.apply_lora(model, ["base"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    # Other layers still can be adapted.
    assert rl.apply_lora(model, ["v_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1)) == [
        "layers.0.v_proj",
        "layers.1.v_proj",
    ]

    shared = rl.Linear(4, 4, rngs=nnx.Rngs(0))
    model = nnx.Dict(a=shared, b=shared)
    with pytest.raises(
        ValueError, match=r"'b' is one layer reached by several paths \['\.a', '\.b'\]"
    ):
        rl.apply_lora(model, ["b"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))

    embed = rl.Embedding(4, 4, rngs=nnx.Rngs(0))
    proj = rl.Linear(4, 4, rngs=nnx.Rngs(0))
    proj.kernel = embed.embedding  # one variable in both modules
    model = nnx.Dict(embed=embed, proj=proj)
    with pytest.raises(
        ValueError, match=r"'proj': its variable \.proj\.kernel is tied to \['\.embed\.embedding'\]"
    ):
        rl.apply_lora(model, ["proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    assert type(proj.kernel) is nnx.Param and proj.kernel is embed.embedding


def test_refuses_a_layer_in_a_tuple():
    class Holder(nnx.Module):
        def __init__(self):
            self.fixed = nnx.data((rl.Linear(4, 4, rngs=nnx.Rngs(0)),))

    model = Holder()
    with pytest.raises(TypeError, match=r"cannot replace the module at \.fixed\[0\]: .* tuple"):
        rl.apply_lora(model, ["fixed.0"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    assert type(model.fixed[0].kernel) is nnx.Param  # checked before the base was frozen
    model.fixed = nnx.data(
        (rl.LoRALinear(rl.Linear(4, 4, rngs=nnx.Rngs(0)), 2, alpha=1.0, rngs=nnx.Rngs(1)),)
    )
    with pytest.raises(TypeError, match=r"cannot replace the module at \.fixed\[0\]"):
        rl.merge_lora(model)
    assert type(model.fixed[0]) is rl.LoRALinear


def test_merge_refuses_adapters_that_are_switched_off():
    """Inside adapters_disabled the model computes its base: a merge there would fold in
    adapters it does not apply. Refused, naming the layers, the model left as it was."""
    rngs = nnx.Rngs(0)
    model = nnx.Dict(q=rl.Linear(4, 4, rngs=rngs), v=rl.Linear(4, 4, rngs=rngs))
    rl.apply_lora(model, ["q", "v"], rank=2, alpha=2.0, rngs=nnx.Rngs(1))
    with rl.adapters_disabled(model):
        with pytest.raises(ValueError, match=r"merge_lora: the adapters of q, v are switched off"):
            rl.merge_lora(model)
    assert all(isinstance(model[k], rl.LoRALinear) for k in ("q", "v"))
    model["v"].adapter_enabled = False  # by hand
    with pytest.raises(ValueError, match=r"the adapters of v are switched off"):
        rl.merge_lora(model)
    model["v"].adapter_enabled = True
    assert rl.merge_lora(model) == ["q", "v"]


def test_merge_and_state_bad_input():
    with pytest.raises(ValueError, match=r"merge_lora: the model has no LoRALinear layer"):
        rl.merge_lora(Net(nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got dict"):
        rl.merge_lora({})
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got list"):
        rl.lora_state([])
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got int"):
        rl.apply_lora(3, ["q"], rank=2, alpha=1.0, rngs=nnx.Rngs(0))
