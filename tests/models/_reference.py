"""What the tests of rudax.models ask of transformers, the reference, written once."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx


def hf_greedy(ref, prompt, n):
    """transformers' greedy continuation of one prompt: exactly ``n`` new token ids."""
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# A tiny model for logit comparisons: two layers of width 32, 16 positions, and 15x
# transformers' init std (initializer_range), so scores are a few units and attention depends
# on position (RoPE) far more than at a real init's near-uniform attention.
V, T = 64, 16
TINY = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=T,
    initializer_range=0.3,
)
IDS = np.random.default_rng(0).integers(0, V, size=(2, T))
# Llama 3.1's RoPE rewrite for head_dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5
# against L / 4 = 64 and L / 1 = 256: one kept, one blended, two divided; every branch of
# the rewrite is used.
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,
)

_logits = nnx.jit(lambda model, ids: model(ids))


def rel_err(got, want):
    """The largest absolute difference over the largest magnitude of ``want``."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def ours(model):
    """A rudax model's logits of ``IDS``, float64."""
    return np.asarray(_logits(model, jnp.asarray(IDS, jnp.int32)), np.float64)


def theirs(torch_model):
    """A transformers (or peft) model's logits of ``IDS``, float64."""
    with torch.no_grad():
        return torch_model(torch.tensor(IDS)).logits.double().numpy()


def hf_model(kind="llama", seed=0, **overrides):
    """A random transformers ``TINY`` Llama (or Qwen2), its norms and biases random too
    (transformers initializes them to ones and zeros)."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()
