"""--remat: the model's decoder layers under activation checkpointing give the same gradients
and the same training run, and need less temporary memory (XLA's own accounting)."""

import dataclasses

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
from examples.lm import config as cfg
from examples.lm import train
from rudax.models import LlamaConfig, ModelSpec
from rudax.models import next_token_loss_sum as loss_sum
from tests.lm.conftest import TINY
from tests.lm.test_train import _losses

LLAMA = LlamaConfig.tiny(
    256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=32, param_dtype=jnp.float32,
)  # fmt: skip
CONFIG = ModelSpec(LLAMA, seq_len=32, dtype=jnp.float32, loss_chunk=32)
MIXTRAL = dataclasses.replace(
    LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
    output_router_logits=True,
)  # fmt: skip
MOE = dataclasses.replace(CONFIG, config=MIXTRAL)


def _layers(spec, n):
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, num_hidden_layers=n))


def _step(spec):
    graphdef, state = nnx.split(spec.create(0))

    def value_and_grad(state, batch):
        loss = lambda s: loss_sum(nnx.merge(graphdef, s), batch, chunk=spec.loss_chunk)[0]
        return jax.value_and_grad(loss)(state)

    return jax.jit(value_and_grad), state


def _bits(tree):
    return [
        (jax.tree_util.keystr(p), np.asarray(x).tobytes())
        for p, x in jax.tree.leaves_with_path(tree)
    ]


@pytest.mark.parametrize(
    "base",  # a Mixtral's blocks remat as a dense model's do: it behind -m slow
    [pytest.param(CONFIG, id="dense"), pytest.param(MOE, id="moe", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("policy", [p for p in rl.REMAT_POLICIES if p != "none"])
def test_gradients_equal_the_plain_ones_bitwise(base, policy):
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, base.config.vocab_size)
    plain, state = _step(base)
    remat, _ = _step(dataclasses.replace(base, remat=policy))
    want, got = plain(state, batch), remat(state, batch)
    assert _bits(got) == _bits(want)


def _saved(spec, capsys):
    """The residuals the backward keeps, one line each (``print_saved_residuals``)."""
    graphdef, state = nnx.split(spec.create(0))
    batch = jnp.zeros((2, spec.seq_len + 1), jnp.int32)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(
        lambda s: loss_sum(nnx.merge(graphdef, s), batch, chunk=spec.loss_chunk)[0], state
    )
    lines = capsys.readouterr().out.splitlines()
    return [
        line for line in lines if not any(w in line for w in ("argument", "constant", "literal"))
    ]


def test_full_remat_keeps_only_each_blocks_input(capsys):
    deep = _layers(CONFIG, 4)
    stream = f"f32[2,{deep.seq_len},{deep.config.hidden_size}]"  # the residual stream
    full = _saved(dataclasses.replace(deep, remat="full"), capsys)
    # rudax/models/_llama_layers.py; rudax/layers/_rope.py, _matmul.py;
    # rudax/kernels/_flash_attention.py.
    inner = ("_llama_layers.py", "attention.py", "_rope.py", "_matmul.py")
    # A layer's output is the next one's input (the stream), counted below; nothing else
    # from inside a layer is kept: all of it is recomputed.
    inside = [
        line for line in full if any(f in line for f in inner) and not line.startswith(stream)
    ]
    assert not inside, inside
    assert sum(line.startswith(stream) for line in full) == deep.config.num_hidden_layers, full
    plain = _saved(deep, capsys)
    assert len(plain) > 4 * len(full)


def test_the_flag_lists_the_library_policies_and_the_config_checks_them():
    assert cfg.REMAT_POLICIES == rl.REMAT_POLICIES
    with pytest.raises(ValueError, match=r"remat must be one of .* got remat='some'"):
        dataclasses.replace(CONFIG, remat="some").create(0)


def test_the_trainer_trains_the_same_run_and_may_change_it_on_resume(data, tmp_path):
    flags = [*data, *TINY, "--optimizer", "adamw"]
    plain = train.main([*flags, "--run-dir", str(tmp_path / "plain")])
    full = train.main(
        [*flags, "--remat", "full", "--run-dir", str(tmp_path / "full"), "--stop-at", "3"]
    )
    assert "remat" not in cfg.RUN_KEYS  # config.json records it, --resume does not check it
    # Not a run flag: the resumed session checkpoints differently, trains the same.
    resumed = train.main(
        [
            *(
                "--resume",
                "--run-dir",
                str(tmp_path / "full"),
                "--remat",
                "dots_with_no_batch_dims",
            ),
            *("--log-every", "1", "--eval-every", "4"),  # session flags, not the run's
        ]
    )
    assert resumed["step"] == plain["step"] == 8
    want = _losses(plain["metrics"])
    got = _losses(resumed["metrics"])
    assert got == want
    assert full["step"] == 3
