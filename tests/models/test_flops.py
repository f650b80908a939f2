"""rudax.models.flops_per_token against the model's own matmul parameters and a count written
out by hand for the trainer's model."""

import pytest
from flax import nnx

from rudax.models import LlamaConfig, LlamaForCausalLM, flops_per_token

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _matmul_params_per_token(config):
    """6x the parameters of the layers' matmuls a token uses, counted from the model."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    total = 0.0
    for path, variable in nnx.to_flat_state(nnx.state(model.model.layers)):
        if path[-1] == "kernel" or path[-1] in ("w1", "w2", "w3"):
            share = 1.0
            if path[-1] in ("w1", "w2", "w3"):  # each token uses k of the E experts
                share = config.num_experts_per_tok / config.num_local_experts
            total += variable.size * share
    return 6 * total


@pytest.mark.parametrize("kind", ["dense", "head-dim", "mixtral"])
def test_the_parameter_term_is_the_models_matmul_parameters(kind):
    extra = {"head-dim": dict(head_dim=32), "mixtral": dict(model_type="mixtral",
             num_local_experts=4, num_experts_per_tok=2)}.get(kind, {})  # fmt: skip
    config = LlamaConfig(**COMMON, **extra)
    c, t = config, 32
    attention = 6 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * t
    head = 6 * c.hidden_size * c.vocab_size
    want = _matmul_params_per_token(config) + attention + head
    assert flops_per_token(config, t) == pytest.approx(want, rel=1e-12)


def test_the_trainers_model_by_hand():
    # LlamaConfig.tiny(): V 8192, d 256, 4 layers of q, k, v, o (d x d each: no GQA) and a
    # SwiGLU of 704, at T = 256:
    #   6 N    = 6 * 4 * (4 * 256 * 256 + 3 * 256 * 704) = 19,267,584
    #   scores = 6 * 4 * 256 * 256                         =  1,572,864  (the causal half)
    #   head   = 6 * 256 * 8192                            = 12,582,912
    assert flops_per_token(LlamaConfig.tiny(), 256) == 33_423_360


def test_a_window_counts_the_keys_each_query_sees():
    plain = LlamaConfig(**COMMON)
    windowed = LlamaConfig(**COMMON, model_type="mistral", sliding_window=8)
    c, t = plain, 32
    per_key = 6 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    # mean keys seen over positions 1..32 under a window of 8: (1+...+8 + 24*8)/32 ~ 7.1,
    # against 16.5 causal; the formula's continuous form: (2W - W^2/T)/2 = 7, T/2 = 16
    diff = flops_per_token(plain, t) - flops_per_token(windowed, t)
    assert diff == pytest.approx(per_key * (32 - (2 * 8 - 64 / 32)), rel=1e-12)
    assert flops_per_token(windowed, 8) == flops_per_token(plain, 8)  # the window covers T


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"config must be a rudax\.models\.LlamaConfig"):
        flops_per_token(COMMON, 8)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1, got seq_len=0"):
        flops_per_token(LlamaConfig(**COMMON), 0)
