"""The catalog of bad inputs to rudax.layers: each is a clear error naming what to fix.

The cases are the mistakes a user makes building a model (a zero size, an integer storage
dtype, a rank larger than the layer) and calling it (a wrong feature axis, integer
activations, float token ids). Negative token ids are not an error under ``jit``: they give NaN
rows, tested in ``test_embedding.py``.
"""

import tempfile
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import rudax.layers as rl
from tests._catalog import Bad, Holds, catalog


def rngs():
    return nnx.Rngs(0)


def linear(in_features=4, out_features=3, **kwargs):
    return rl.Linear(in_features, out_features, rngs=rngs(), **kwargs)


def embedding(**kwargs):
    return rl.Embedding(5, 3, rngs=rngs(), **kwargs)


def _two_projections():
    return nnx.Dict(q_proj=linear(), v_proj=linear())


def _damaged_adapter() -> None:
    """Issue 29: a truncated adapter file gave safetensors' own error, naming no file."""
    model = _two_projections()
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4, rngs=rngs())
    folder = Path(tempfile.mkdtemp())
    rl.save_adapter(model, folder, base_model_name_or_path="tiny")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])
    rl.load_adapter(_two_projections(), folder)


def _a_target_that_matches_nothing_warns() -> None:
    """Issue 29: peft says nothing of a listed target that matches no layer; rudax warns,
    naming it, and adapts the layers the other targets match."""
    model = _two_projections()
    with pytest.warns(UserWarning, match=r"targets \['qkv_proj'\] match no module"):
        assert rl.apply_lora(model, ["q_proj", "qkv_proj"], rank=2, alpha=4, rngs=rngs()) == [
            "q_proj"
        ]


CASES = [
    Bad(
        "adapter-file-damaged",
        _damaged_adapter,
        ValueError,
        r"load_adapter: \S+adapter_model\.safetensors is not a readable safetensors file",
    ),
    Holds("lora-target-that-matches-nothing", _a_target_that_matches_nothing_warns),
    Bad(
        "linear-in-features-0",
        lambda: linear(0),
        ValueError,
        r"in_features must be a positive int, got in_features=0",
    ),
    Bad(
        "linear-float-size",
        lambda: linear(4.0),
        TypeError,
        r"in_features must be an int, got in_features=4\.0",
    ),
    Bad(
        "linear-int-param-dtype",
        lambda: linear(param_dtype=jnp.int32),
        TypeError,
        r"param_dtype must be a floating dtype, got param_dtype=.*int32",
    ),
    Bad(
        "linear-wrong-feature-axis",
        lambda: linear()(jnp.ones((2, 5))),
        ValueError,
        r"Linear expects x\.shape\[-1\] == 4 .* got x\.shape=\(2, 5\)",
    ),
    Bad(
        "linear-transposed-input",
        lambda: linear()(jnp.ones((4, 2))),
        ValueError,
        r"Linear expects x\.shape\[-1\] == 4 .* got x\.shape=\(4, 2\)",
    ),
    Bad(
        "linear-int-activations",
        lambda: linear()(jnp.ones((2, 4), jnp.int32)),
        TypeError,
        r"Linear expects a floating input, got x\.dtype=int32",
    ),
    Bad(
        "embedding-0-rows",
        lambda: rl.Embedding(0, 3, rngs=rngs()),
        ValueError,
        r"num_embeddings must be a positive int, got num_embeddings=0",
    ),
    Bad(
        "embedding-float-ids",
        lambda: embedding()(jnp.array([1.0, 2.0])),
        TypeError,
        r"Embedding expects integer ids, got ids\.dtype=float32",
    ),
    Bad(
        "tied-projection-of-a-linear",
        lambda: rl.TiedProjection(linear()),
        TypeError,
        r"embedding must be a rudax\.layers\.Embedding",
    ),
    Bad(
        "tied-projection-bias-shape",
        lambda: rl.TiedProjection(embedding(), bias=jnp.zeros(4)),
        ValueError,
        r"bias must have shape \(5,\), got bias\.shape=\(4,\)",
    ),
    Bad(
        "tied-projection-int-bias",
        lambda: rl.TiedProjection(embedding(), bias=jnp.zeros(5, jnp.int32)),
        TypeError,
        r"bias must have a floating dtype, got bias\.dtype=int32",
    ),
    Bad(
        "tied-projection-wrong-feature-axis",
        lambda: rl.TiedProjection(embedding())(jnp.ones((2, 4))),
        ValueError,
        r"TiedProjection expects x\.shape\[-1\] == 3 .* got x\.shape=\(2, 4\)",
    ),
    Bad(
        "rms-norm-negative-epsilon",
        lambda: rl.RMSNorm(4, epsilon=-1.0, rngs=rngs()),
        ValueError,
        r"epsilon must be a finite number > 0, got epsilon=-1\.0",
    ),
    Bad(
        "rms-norm-wrong-feature-axis",
        lambda: rl.RMSNorm(4, rngs=rngs())(jnp.ones((2, 5))),
        ValueError,
        r"RMSNorm expects x\.shape\[-1\] == 4 .* got x\.shape=\(2, 5\)",
    ),
    Bad(
        "layer-norm-int-activations",
        lambda: rl.LayerNorm(4, rngs=rngs())(jnp.ones((2, 4), jnp.int32)),
        TypeError,
        r"LayerNorm expects a floating input, got x\.dtype=int32",
    ),
    Bad(
        "gated-mlp-hidden-0",
        lambda: rl.GatedMLP(4, 0, rngs=rngs()),
        ValueError,
        r"hidden_features must be a positive int, got hidden_features=0",
    ),
    Bad(
        "gated-mlp-wrong-feature-axis",
        lambda: rl.GatedMLP(4, 8, rngs=rngs())(jnp.ones((2, 5))),
        ValueError,
        r"GatedMLP expects x\.shape\[-1\] == 4 .* got x\.shape=\(2, 5\)",
    ),
    Bad(
        "lora-of-a-norm",
        lambda: rl.LoRALinear(rl.RMSNorm(4, rngs=rngs()), 2, alpha=4.0, rngs=rngs()),
        TypeError,
        r"base must be a rudax\.layers\.Linear",
    ),
    Bad(
        "lora-rank-0",
        lambda: rl.LoRALinear(linear(), 0, alpha=4.0, rngs=rngs()),
        ValueError,
        r"rank must be a positive int, got rank=0",
    ),
    Bad(
        "lora-negative-alpha",
        lambda: rl.LoRALinear(linear(), 2, alpha=-1.0, rngs=rngs()),
        ValueError,
        r"alpha must be a finite number > 0, got alpha=-1\.0",
    ),
    Bad(
        "lora-dropout-1",
        lambda: rl.LoRALinear(linear(), 2, alpha=4.0, dropout=1.0, rngs=rngs()),
        ValueError,
        r"dropout must be in \[0, 1\), got dropout=1\.0",
    ),
    Bad(
        "lora-unknown-scale-rule",
        lambda: rl.LoRALinear(linear(), 2, alpha=4.0, scale_rule="rslora", rngs=rngs()),
        ValueError,
        r"scale_rule must be one of .* got scale_rule='rslora'",
    ),
    Bad(
        "dropout-rate-above-1",
        lambda: rl.Dropout(1.5, rngs=rngs()),
        ValueError,
        r"rate must be in \[0, 1\), got rate=1\.5",
    ),
    Bad(
        "dropout-training-without-rngs",
        lambda: rl.Dropout(0.5)(jnp.ones(3), deterministic=False),
        ValueError,
        r"Dropout was built with rngs=None.*pass rngs=nnx\.Rngs\(dropout=seed\)",
    ),
    Bad(
        "to-dtype-int",
        lambda: rl.to_dtype(linear(), jnp.int32),
        TypeError,
        r"dtype must be bfloat16, float16 or float32, got dtype=.*int32",
    ),
]

test_bad_input = catalog(CASES)
