"""rudax.models.LlamaForCausalLM and generate against transformers, the reference.

Tiny random transformers models (Llama with and without tied embeddings and with Llama 3.1's
RoPE scaling, head_dim apart from hidden / heads, Qwen2's biases, Mistral's sliding window)
have their weights copied in by Hugging Face name; logits must agree within 1e-5 relative
and greedy generation token for token over 64 new tokens, prompts of different lengths
batched together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import rudax.layers as rl
from rudax.models import KVCache, LlamaConfig, LlamaForCausalLM, generate
from rudax.models._hf_names import load_state, state_dict
from tests.models._reference import hf_greedy

V = 128


def _hf_model(kind):
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if kind == "llama-tied":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    elif kind == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    elif kind == "llama3-scaled":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = transformers.LlamaConfig(**common, rope_parameters=rope)
    elif kind == "llama-head-dim-32":
        config = transformers.LlamaConfig(**common, head_dim=32, attention_bias=True)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif kind == "mistral-window-8":
        config = transformers.MistralConfig(**common, sliding_window=8)
    else:
        raise AssertionError(kind)
    # eager attention: the plain reference (no fused kernel's own rounding)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return ref.eval()


def _ours(ref):
    config = LlamaConfig.from_hf(ref.config.to_dict(), param_dtype=jnp.float32)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    tensors = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    load_state(model, tensors.__getitem__, set(tensors))
    return model


KINDS = ["llama-tied", "llama", "llama3-scaled", "llama-head-dim-32", "qwen2", "mistral-window-8"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_transformers(kind):
    ref = _hf_model(kind)
    model = _ours(ref)
    ids = np.random.default_rng(0).integers(0, V, (2, 40))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), kind


@pytest.mark.parametrize("kind", ["llama-tied", "llama3-scaled", "qwen2", "mistral-window-8"])
def test_greedy_generation_equals_transformers_for_64_tokens(kind):
    ref = _hf_model(kind)
    model = _ours(ref)
    prompts = [[5, 17, 3, 99, 4, 8, 1, 12, 40, 2, 9], [7, 7, 2], [100]]
    got = generate(model, prompts, 64, stop_tokens=[])
    for prompt, row in zip(prompts, got, strict=True):
        assert row == hf_greedy(ref, prompt, 64), (kind, prompt)


def test_decoding_with_the_cache_gives_the_full_forward_logits():
    model = _ours(_hf_model("mistral-window-8"))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 20)))
    full = model(ids)
    # prefill 12 tokens (the second row left-padded by 4), then 8 single-token steps
    pad = jnp.array([0, 4])
    slot = jnp.arange(12)[None, :]
    real = slot >= pad[:, None]
    prompt = jnp.where(real, jnp.concatenate([ids[:1, :12], jnp.roll(ids[1:, :12], 4, 1)]), 0)
    positions = jnp.where(real, slot - pad[:, None], 0)
    cache = model.init_cache(2, 32)
    logits, cache = model(prompt, positions=positions, segment_ids=real.astype(int), cache=cache)
    assert isinstance(cache, KVCache) and int(cache.length) == 12
    np.testing.assert_allclose(logits[0], full[0, :12], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1, 4:], full[1, :8], rtol=1e-5, atol=1e-5)
    for step in range(8):
        t = jnp.array([12 + step, 8 + step])  # each row's next token
        token = ids[jnp.arange(2), t][:, None]
        logits, cache = model(token, positions=t[:, None], cache=cache)
        np.testing.assert_allclose(logits[0, 0], full[0, 12 + step], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits[1, 0], full[1, 8 + step], rtol=1e-5, atol=1e-5)


def test_sampling_options_and_stop_tokens():
    model = _ours(_hf_model("llama"))
    prompts = [[1, 2, 3], [4]]
    greedy = generate(model, prompts, 20, stop_tokens=[])
    # top_k=1 and a tiny top_p keep the argmax only: sampling then is greedy
    assert generate(model, prompts, 20, temperature=0.7, top_k=1, stop_tokens=[]) == greedy
    assert generate(model, prompts, 20, temperature=1.3, top_p=1e-6, stop_tokens=[]) == greedy
    key = jax.random.key(3)
    sampled = generate(model, prompts, 20, temperature=1.0, rng=key, stop_tokens=[])
    assert sampled == generate(model, prompts, 20, temperature=1.0, rng=key, stop_tokens=[])
    assert sampled != greedy  # at temperature 1 a random model's choices are spread out
    # a row ends at its first stop token, which it keeps; the other row runs on
    stop = greedy[0][4]
    first = greedy[0].index(stop)
    out = generate(model, prompts, 20, stop_tokens=[stop])
    assert out[0] == greedy[0][: first + 1]
    if stop not in greedy[1]:
        assert out[1] == greedy[1]


def test_a_lora_model_generates_and_starts_as_its_base():
    ref = _hf_model("llama")
    base = generate(_ours(ref), [[3, 1, 4, 1, 5]], 16, stop_tokens=[])
    model = _ours(ref)
    rl.apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8, rngs=nnx.Rngs(1))
    assert model.model.layers[1].self_attn.v_proj.__class__.__name__ == "LoRALinear"
    assert generate(model, [[3, 1, 4, 1, 5]], 16, stop_tokens=[]) == base  # B starts at 0
    # an NF4 base with adapters (QLoRA) generates through the same cache
    qlora = _ours(ref)
    rl.apply_lora(qlora, ["q_proj", "down_proj"], rank=4, alpha=8, quantize_base="nf4",
                  rngs=nnx.Rngs(1))  # fmt: skip
    out = generate(qlora, [[3, 1, 4, 1, 5]], 16, stop_tokens=[])
    assert len(out[0]) == 16 and all(0 <= t < V for t in out[0])


def test_stacked_layers_generate_and_save_as_the_per_layer_model(tmp_path):
    ref = _hf_model("mistral-window-8")
    model = _ours(ref)
    prompts = [[5, 17, 3, 99, 4], [7, 2]]
    want = generate(model, prompts, 16, stop_tokens=[])
    files = state_dict(model)
    model.scan_layers = True  # stacked in place: one [L, ...] leaf per parameter
    assert model.model.layers.self_attn.k_proj.kernel.shape == (2, 64, 32)
    assert generate(model, prompts, 16, stop_tokens=[]) == want
    stacked_files = state_dict(model)
    assert stacked_files.keys() == files.keys()
    for name, value in files.items():
        np.testing.assert_array_equal(np.asarray(stacked_files[name]), np.asarray(value))
    # read back into a stacked model by name
    back = LlamaForCausalLM(model.config, scan_layers=True, rngs=nnx.Rngs(1))
    load_state(back, lambda n: np.asarray(files[n]), set(files))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (1, 12)))
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))
    model.scan_layers = False
    assert len(model.model.layers) == 2 and generate(model, prompts, 16, stop_tokens=[]) == want


def test_state_dict_round_trips_in_torch_layout():
    ref = _hf_model("llama-tied")
    model = _ours(ref)
    ours = state_dict(model)
    theirs = ref.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, value in ours.items():
        np.testing.assert_array_equal(np.asarray(value), theirs[name].numpy(), err_msg=name)


def test_a_model_without_a_cache_is_refused_by_name():
    with pytest.raises(TypeError, match=r"model must be a rudax\.models causal LM .* got Linear"):
        generate(rl.Linear(2, 2, rngs=nnx.Rngs(0)), [[1]], 4)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "match"),
    [
        ([], {}, ValueError, "at least one row"),
        ([[1], []], {}, ValueError, "at least one row, each of at least one token"),
        ([[1, V]], {}, ValueError, rf"prompts\[0\] holds token id {V}, outside \[0, {V}\)"),
        ([[1]], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ([[1]], {"temperature": -1.0}, ValueError, "temperature must be a number >= 0"),
        ([[1]], {"top_p": 0.0}, ValueError, r"top_p must be None or in \(0, 1\]"),
        ([[1]], {"top_k": 0}, ValueError, "top_k must be None or an int >= 1"),
    ],
)
def test_bad_generate_arguments(prompts, kwargs, error, match):
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        rngs=nnx.Rngs(0),
    )
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        generate(model, prompts, **kwargs)


def test_an_adapter_saved_from_the_model_loads_in_peft_with_equal_logits(tmp_path):
    import peft

    ref = _hf_model("llama")
    model = _ours(ref)
    names = rl.apply_lora(
        model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, rngs=nnx.Rngs(1)
    )
    # module paths are the peft names: no names= mapping needed
    assert "model.layers.0.self_attn.q_proj" in names
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rl.LoRALinear):  # adapters as training would leave them
            node.lora_b.set_value(jax.random.normal(jax.random.key(7), node.lora_b.shape) * 0.05)
    rl.save_adapter(model, tmp_path, base_model_name_or_path="local/tiny")
    loaded = peft.PeftModel.from_pretrained(_hf_model("llama"), str(tmp_path)).eval()
    ids = np.random.default_rng(2).integers(0, V, (2, 24))
    with torch.no_grad():
        want = loaded(torch.tensor(ids)).logits.numpy()
        base = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(want - base).max() > 1e-3  # the adapters change the output
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
