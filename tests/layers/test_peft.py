"""rudax.layers.save_adapter / load_adapter against peft's own files (CPU, fp32).

Both directions on the torch twin of tests/layers/test_apply_lora.py: an adapter rudax trained
and saved loads in ``peft.PeftModel.from_pretrained`` and computes what rudax computes; one peft
saved loads into rudax and does the same. Every refused file is a clear error.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

import rudax.layers as rl
from tests.layers._random import normal
from tests.layers.test_apply_lora import (
    LAYERS,
    Net,
    TorchNet,
    X,
    modules_by_name,
    peft_adapted,
    set_torch_adapters,
    torch_out,
    twin,
)

PREFIX = "base_model.model."


def train_a_few_steps(model, steps=3):
    """Plain SGD on the adapters only (the functional split), so B is no longer zero."""
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    target = normal((*X.shape[:-1], 5), 9)
    loss = lambda p: jnp.sum((nnx.merge(graphdef, p, rest)(X) - target) ** 2)
    tx = optax.sgd(0.01)
    opt_state = tx.init(adapters)
    grad = jax.jit(jax.grad(loss))
    for _ in range(steps):
        updates, opt_state = tx.update(grad(adapters), opt_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
    nnx.update(model, adapters)


def read(directory):
    config = json.loads((pathlib.Path(directory) / "adapter_config.json").read_text())
    with safe_open(str(pathlib.Path(directory) / "adapter_model.safetensors"), "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


def write(directory, config, tensors):
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(tensors, str(directory / "adapter_model.safetensors"))


# ---------------------------------------------------------------------------- rudax -> peft


@pytest.mark.parametrize(
    "targets, rule, written",
    [
        (["q_proj", "v_proj"], "alpha/rank", ["q_proj", "v_proj"]),
        # The short names would also pick layers.1.q_proj: the exact regex is written instead.
        (
            ["layers.0.q_proj", "mlp.up"],
            "alpha/sqrt(rank)",
            r"layers\.0\.mlp\.up|layers\.0\.q_proj|layers\.1\.mlp\.up",
        ),
    ],
    ids=["names", "regex-rslora"],
)
def test_a_rudax_trained_adapter_loads_in_peft_with_the_same_outputs(
    tmp_path, targets, rule, written
):
    torch_net = TorchNet()
    model = twin(torch_net)
    names = rl.apply_lora(model, targets, rank=4, alpha=8.0, scale_rule=rule, rngs=nnx.Rngs(1))
    train_a_few_steps(model)
    mods = modules_by_name(model)
    assert all(np.abs(mods[n].lora_b[...]).max() > 0 for n in names)
    saved = rl.save_adapter(model, tmp_path, base_model_name_or_path="local/tiny", task_type=None)
    assert saved == names

    config, tensors = read(tmp_path)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["use_rslora"] == (rule == "alpha/sqrt(rank)")
    assert config["base_model_name_or_path"] == "local/tiny" and config["task_type"] is None
    assert config["target_modules"] == written
    for n in names:
        assert tensors[f"{PREFIX}{n}.lora_A.weight"].shape == (4, mods[n].in_features)
        np.testing.assert_array_equal(tensors[f"{PREFIX}{n}.lora_B.weight"], mods[n].lora_b[...].T)
    assert len(tensors) == 2 * len(names)

    loaded = peft.PeftModel.from_pretrained(TorchNet(), str(tmp_path))
    assert peft_adapted(loaded) == set(names)
    np.testing.assert_allclose(torch_out(loaded, X), model(X), rtol=1e-5, atol=1e-5)
    assert np.abs(torch_out(loaded, X) - torch_out(torch_net, X)).max() > 1e-3  # it trained


# ---------------------------------------------------------------------------- peft -> rudax


@pytest.fixture(params=[False, True], ids=["alpha/rank", "rslora"])
def peft_dir(tmp_path, request):
    """A peft-initialised adapter, B set non-zero by hand, saved by peft."""
    torch_net = TorchNet()
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "down"], use_rslora=request.param
    )
    peft_model = peft.get_peft_model(torch_net, config)
    set_torch_adapters(peft_model)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    return tmp_path / "peft", torch_out(peft_model, X), request.param


def test_a_peft_adapter_loads_into_a_bare_rudax_model(peft_dir):
    directory, expected, use_rslora = peft_dir
    model = twin(TorchNet())
    names = rl.load_adapter(model, directory)
    assert names == sorted(f"layers.{i}.{n}" for i in range(LAYERS) for n in ("mlp.down", "q_proj"))
    lora = modules_by_name(model)["layers.1.q_proj"]
    scale = 6 / np.sqrt(2) if use_rslora else 3.0
    assert (lora.rank, lora.scale, lora.lora_a.dtype) == (2, scale, jnp.float32)
    np.testing.assert_allclose(model(X), expected, rtol=1e-5, atol=1e-5)


def test_a_peft_adapter_loads_into_an_adapted_rudax_model(peft_dir):
    directory, expected, use_rslora = peft_dir
    model = twin(TorchNet())
    rule = "alpha/sqrt(rank)" if use_rslora else "alpha/rank"
    rl.apply_lora(model, ["q_proj", "down"], rank=2, alpha=6.0, scale_rule=rule, rngs=nnx.Rngs(7))
    rl.load_adapter(model, directory)
    np.testing.assert_allclose(model(X), expected, rtol=1e-5, atol=1e-5)


def test_bf16_adapters_round_trip_exactly(tmp_path):
    model = Net(nnx.Rngs(0))
    names = rl.apply_lora(
        model, ["v_proj"], rank=2, alpha=4.0, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)
    )
    mods = modules_by_name(model)
    for i, n in enumerate(names):
        mods[n].lora_b[...] = normal((2, mods[n].out_features), i, jnp.bfloat16)
    rl.save_adapter(model, tmp_path, base_model_name_or_path=None)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    into_bf16 = Net(nnx.Rngs(0))
    rl.apply_lora(
        into_bf16, ["v_proj"], rank=2, alpha=4.0, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(5)
    )
    bare = Net(nnx.Rngs(0))
    for target in (into_bf16, bare):
        rl.load_adapter(target, tmp_path)
        loaded = modules_by_name(target)
        for n in names:
            for ab in ("lora_a", "lora_b"):
                got, saved = getattr(loaded[n], ab)[...], getattr(mods[n], ab)[...]
                assert got.dtype == (jnp.bfloat16 if target is into_bf16 else jnp.float32)
                np.testing.assert_array_equal(
                    np.asarray(got, np.float32), np.asarray(saved, np.float32)
                )


# ---------------------------------------------------------------------------- load mode


@pytest.fixture
def dropout_dir(tmp_path):
    """An adapter saved with lora_dropout=0.5 and B non-zero, so dropout changes the output,
    and the trained model it came from in eval mode (the adapters' full, undropped output)."""
    trained = Net(nnx.Rngs(0))
    names = rl.apply_lora(
        trained, ["q_proj", "up"], rank=2, alpha=4.0, dropout=0.5, rngs=nnx.Rngs(1)
    )
    mods = modules_by_name(trained)
    for i, n in enumerate(names):
        mods[n].lora_b[...] = normal((2, mods[n].out_features), i)
    rl.save_adapter(trained, tmp_path, base_model_name_or_path=None)
    trained.eval()
    return tmp_path, trained(X)


def _adapted(adapted):
    """A bare Net, or one already adapted as the file (still in training mode)."""
    model = Net(nnx.Rngs(0))
    if adapted:
        rl.apply_lora(model, ["q_proj", "up"], rank=2, alpha=4.0, dropout=0.5, rngs=nnx.Rngs(2))
    return model


@pytest.mark.parametrize("adapted", [False, True], ids=["bare", "adapted"])
def test_a_loaded_model_is_in_inference_mode_as_peft_by_default(dropout_dir, adapted):
    # Issue 28: lora_dropout stayed active after load_adapter, so two calls differed; peft's
    # PeftModel.from_pretrained(..., is_trainable=False) returns a model in eval mode.
    directory, expected = dropout_dir
    model = _adapted(adapted)
    rl.load_adapter(model, directory, rngs=nnx.Rngs(3))
    first = model(X)
    np.testing.assert_array_equal(model(X), first)
    np.testing.assert_allclose(first, expected, rtol=1e-6, atol=1e-6)
    loras = [m for m in modules_by_name(model).values() if isinstance(m, rl.LoRALinear)]
    assert len(loras) == 2 * LAYERS and all(m.dropout.deterministic for m in loras)


@pytest.mark.parametrize("adapted", [False, True], ids=["bare", "adapted"])
def test_is_trainable_keeps_dropout_active(dropout_dir, adapted):
    directory, expected = dropout_dir
    model = _adapted(adapted)
    rl.load_adapter(model, directory, rngs=nnx.Rngs(3), is_trainable=True)
    # Each call draws a fresh mask from the layers' streams.
    first, second = model(X), model(X)
    assert np.abs(first - second).max() > 1e-3
    assert np.abs(first - expected).max() > 1e-3
    # Different rngs at load, different masks.
    other = _adapted(adapted)
    rl.load_adapter(other, directory, rngs=nnx.Rngs(4), is_trainable=True)
    if not adapted:  # an adapted model keeps its own streams (rngs=2 in both)
        assert np.abs(other(X) - first).max() > 1e-3
    model.eval()
    np.testing.assert_allclose(model(X), expected, rtol=1e-6, atol=1e-6)


def test_is_trainable_leaves_an_eval_model_in_eval_mode(dropout_dir):
    # As peft, which only calls eval() when is_trainable is False and never train().
    directory, expected = dropout_dir
    model = _adapted(adapted=True)
    model.eval()
    rl.load_adapter(model, directory, is_trainable=True)
    np.testing.assert_allclose(model(X), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- save errors


def test_save_adapter_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"save_adapter: the model has no LoRALinear layer"):
        rl.save_adapter(Net(nnx.Rngs(0)), tmp_path, base_model_name_or_path=None)
    model = Net(nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    rl.apply_lora(model, ["up"], rank=4, alpha=4.0, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"the layers differ: .*'layers\.0\.mlp\.up': \(4, 4\.0"):
        rl.save_adapter(model, tmp_path, base_model_name_or_path=None)
    with pytest.raises(TypeError, match=r"base_model_name_or_path must be a str or None, got"):
        rl.save_adapter(model, tmp_path, base_model_name_or_path=3)
    with pytest.raises(TypeError, match=r"task_type must be a str or None, got task_type=1"):
        rl.save_adapter(model, tmp_path, base_model_name_or_path=None, task_type=1)
    with pytest.raises(ValueError, match=r"no LoRALinear layer with a name"):
        rl.save_adapter(model, tmp_path, base_model_name_or_path=None, names=lambda p: None)
    assert not (tmp_path / "adapter_config.json").exists()


# ---------------------------------------------------------------------------- load errors


@pytest.fixture
def saved(tmp_path):
    """A valid rudax adapter on q_proj (rank 2), its config and tensors, to spoil one by one."""
    model = Net(nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    rl.save_adapter(model, tmp_path / "good", base_model_name_or_path=None)
    config, tensors = read(tmp_path / "good")
    return tmp_path, config, tensors


A0 = f"{PREFIX}layers.0.q_proj.lora_A.weight"
B0 = f"{PREFIX}layers.0.q_proj.lora_B.weight"


def _config_case(field, value):
    return lambda config, tensors: (config.update({field: value}), tensors)[1]


def _drop(field):
    return lambda config, tensors: (config.pop(field), tensors)[1]


def _tensors(fn):
    return lambda config, tensors: fn(dict(tensors))


LOAD_ERRORS = [
    (
        "peft_type",
        _config_case("peft_type", "PROMPT_TUNING"),
        r"peft_type must be 'LORA', got 'PROMPT_TUNING'",
    ),
    ("no-r", _drop("r"), r"missing field 'r'"),
    ("no-targets", _drop("target_modules"), r"missing field 'target_modules'"),
    ("r-0", _config_case("r", 0), r"r must be a positive int, got r=0"),
    (
        "alpha",
        _config_case("lora_alpha", -1),
        r"lora_alpha must be a number > 0, got lora_alpha=-1",
    ),
    ("rslora", _config_case("use_rslora", "yes"), r"use_rslora must be true or false, got 'yes'"),
    (
        "dropout",
        _config_case("lora_dropout", 1.0),
        r"lora_dropout must be in \[0, 1\), got lora_dropout=1\.0",
    ),
    (
        "fan_in_fan_out",
        _config_case("fan_in_fan_out", True),
        r"fan_in_fan_out=True is not supported",
    ),
    ("bias", _config_case("bias", "all"), r"bias='all' is not supported"),
    ("dora", _config_case("use_dora", True), r"use_dora=True is not supported"),
    (
        "rank_pattern",
        _config_case("rank_pattern", {"q_proj": 4}),
        r"rank_pattern=\{'q_proj': 4\} is not",
    ),
    (
        "alpha_pattern",
        _config_case("alpha_pattern", {"q_proj": 8}),
        r"alpha_pattern=\{'q_proj': 8\} is not",
    ),
    ("lora_bias", _config_case("lora_bias", True), r"lora_bias=True is not supported"),
    (
        "modules_to_save",
        _config_case("modules_to_save", ["head"]),
        r"modules_to_save=\['head'\] is not",
    ),
    (
        "layers",
        _config_case("layers_to_transform", [0]),
        r"layers_to_transform=\[0\] is not supported",
    ),
    (
        "unknown",
        _config_case("new_feature", {"on": 1}),
        r"new_feature=\{'on': 1\} is not supported",
    ),
    (
        "pissa",
        _config_case("init_lora_weights", "pissa"),
        r"init_lora_weights='pissa' is not supported",
    ),
    (
        "targets-none",
        _config_case("target_modules", ["k_proj"]),
        r"adapter_config\.json: target_modules: targets=\['k_proj'\] matches no module",
    ),
    (
        "unexpected-module",
        _tensors(lambda t: {**t, f"{PREFIX}head.lora_A.weight": np.zeros((2, 8), np.float32)}),
        r"unexpected key base_model\.model\.head\.lora_A\.weight: the model adapts no module "
        r"named 'head'",
    ),
    (
        "not-lora",
        _tensors(
            lambda t: {
                **t,
                f"{PREFIX}layers.0.q_proj.base_layer.weight": np.zeros((8, 8), np.float32),
            }
        ),
        r"unexpected key 'base_model\.model\.layers\.0\.q_proj\.base_layer\.weight'",
    ),
    (
        "missing",
        _tensors(lambda t: {k: v for k, v in t.items() if k != B0}),
        r"missing key base_model\.model\.layers\.0\.q_proj\.lora_B\.weight "
        r"\(expected shape \[8, 2\]\)",
    ),
    (
        "shape",
        _tensors(lambda t: {**t, A0: np.zeros((2, 5), np.float32)}),
        r"lora_A\.weight has shape \[2, 5\], the model expects \[2, 8\]",
    ),
    (
        "rank",
        _tensors(lambda t: {**t, B0: np.zeros((8, 3), np.float32)}),
        r"lora_B\.weight has shape \[8, 3\], the model expects \[8, 2\]",
    ),
    (
        "dtype",
        _tensors(lambda t: {**t, A0: np.zeros((2, 8), np.int32)}),
        r"lora_A\.weight has dtype I32, not a floating dtype",
    ),
]


@pytest.mark.parametrize(
    "spoil, match", [c[1:] for c in LOAD_ERRORS], ids=[c[0] for c in LOAD_ERRORS]
)
def test_load_adapter_refuses(saved, spoil, match):
    tmp_path, config, tensors = saved
    tensors = spoil(config, tensors)
    write(tmp_path / "bad", config, tensors)
    model = Net(nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        rl.load_adapter(model, tmp_path / "bad")
    # Checked before anything changed: still the bare model.
    assert not any(isinstance(m, rl.LoRALinear) for m in modules_by_name(model).values())


def test_load_adapter_refuses_a_different_rank_or_scale_and_bad_arguments(saved):
    tmp_path, _, _ = saved
    model = Net(nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj"], rank=4, alpha=4.0, rngs=nnx.Rngs(1))
    with pytest.raises(
        ValueError,
        match=r"'layers\.0\.q_proj' has rank=4, scale=1\.0 in the model, the file r=2, scale=2\.0",
    ):
        rl.load_adapter(model, tmp_path / "good")
    model = Net(nnx.Rngs(0))
    rl.apply_lora(
        model, ["q_proj"], rank=2, alpha=4.0, scale_rule="alpha/sqrt(rank)", rngs=nnx.Rngs(1)
    )
    with pytest.raises(ValueError, match=r"has rank=2, scale=2\.828.* the file r=2, scale=2\.0"):
        rl.load_adapter(model, tmp_path / "good")
    model = Net(nnx.Rngs(0))
    rl.apply_lora(model, ["q_proj", "v_proj"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))
    with pytest.raises(
        ValueError, match=r"missing key base_model\.model\.layers\.0\.v_proj\.lora_A\.weight"
    ):
        rl.load_adapter(model, tmp_path / "good")
    with pytest.raises(FileNotFoundError, match=r"nowhere/adapter_config\.json does not exist"):
        rl.load_adapter(model, tmp_path / "nowhere")
    (tmp_path / "good" / "adapter_config.json").write_text("{r: 2")
    with pytest.raises(ValueError, match=r"adapter_config\.json: not valid JSON"):
        rl.load_adapter(model, tmp_path / "good")
    with pytest.raises(TypeError, match=r"rngs must be an nnx\.Rngs or None, got int"):
        rl.load_adapter(model, tmp_path / "good", rngs=0)
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got dict"):
        rl.load_adapter({}, tmp_path / "good")
    bare = Net(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"is_trainable must be a bool, got is_trainable='yes'"):
        rl.load_adapter(bare, tmp_path / "good", is_trainable="yes")
    assert not any(isinstance(m, rl.LoRALinear) for m in modules_by_name(bare).values())
