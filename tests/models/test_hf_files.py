"""from_pretrained / save_pretrained against folders transformers writes and reads.

Tiny random ``LlamaForCausalLM`` checkpoints saved by transformers (tied and untied,
sharded and not, fp32 and bf16), read by rudax; rudax's folders read by transformers'
``AutoModelForCausalLM`` and ``AutoTokenizer`` (eos, pad, chat template and dtype kept); and
the hostile or stale folders transformers refuses or reads otherwise.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from flax import nnx

import rudax.layers as rl
from rudax.models import LlamaForCausalLM, from_pretrained, save_pretrained

V = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _hf(tie=True, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        **kw,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _tokenizer_folder(path):
    """A word-level tokenizer with eos, pad and a chat template, as transformers saves it."""
    words = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
    words += [f"w{i}" for i in range(V - len(words))]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor(ids)).logits.float().numpy()


IDS = np.random.default_rng(0).integers(0, V, (2, 17))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shard", [None, "20KB"], ids=["one-file", "sharded"])
def test_reads_what_transformers_saves(tmp_path, tie, shard):
    ref = _hf(tie=tie)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    ref.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    model = from_pretrained(tmp_path)
    assert model.config.eos_token_id == 2 and model.config.tie_word_embeddings == tie
    want = _logits(ref, IDS)
    got = np.asarray(model(jnp.asarray(IDS)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_bf16_is_read_and_written_as_bf16_bit_for_bit(tmp_path):
    ref = _hf(dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    assert model.config.param_dtype == jnp.bfloat16
    q = model.model.layers[0].self_attn.q_proj.kernel
    assert q.dtype == jnp.bfloat16
    theirs = ref.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(q[...], np.float32), theirs)
    save_pretrained(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.dtype == torch.bfloat16  # the base's storage dtype kept, not fp32
    for (name, a), (_, b) in zip(
        sorted(ref.state_dict().items()), sorted(back.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name


def test_transformers_reads_what_rudax_saves_with_its_tokenizer(tmp_path):
    ref = _hf(tie=False)
    ref.save_pretrained(tmp_path / "base")
    tok = _tokenizer_folder(tmp_path / "base")
    model = from_pretrained(tmp_path / "base")
    save_pretrained(model, tmp_path / "out", tokenizer=tmp_path / "base")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(_logits(back, IDS), _logits(ref, IDS), rtol=0, atol=0)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (again.eos_token, again.pad_token, again.bos_token) == ("</s>", "<pad>", "<s>")
    assert again.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "w1 w2"}]
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_a_single_file_wins_over_a_stale_index_as_in_transformers(tmp_path):
    old, new = _hf(), _hf()
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(2.0)
    old.save_pretrained(tmp_path, max_shard_size="20KB")  # the stale shards and index
    new.save_pretrained(tmp_path / "single")
    os.replace(tmp_path / "single" / "model.safetensors", tmp_path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_array_equal(_logits(theirs, IDS), _logits(new, IDS))
    ours = np.asarray(from_pretrained(tmp_path)(jnp.asarray(IDS)))
    want = _logits(new, IDS)
    assert np.abs(ours - want).max() <= 1e-5 * np.abs(want).max()


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path):
    _hf().save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    folder = tmp_path / "ckpt"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    os.replace(folder / first, tmp_path / "outside.safetensors")
    for name, value in index["weight_map"].items():
        if value == first:
            index["weight_map"][name] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"'\.\./outside\.safetensors'.* outside .*refused"):
        from_pretrained(folder)
    # a symlink inside the folder that points outside is the same escape
    (folder / first).symlink_to(tmp_path / "outside.safetensors")
    for name, value in index["weight_map"].items():
        if value == "../outside.safetensors":
            index["weight_map"][name] = first
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"'{first}'.* outside .*refused"):
        from_pretrained(folder)


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    ref = _hf(tie=False)
    ref.save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.2.input_layernorm.weight'"):
        from_pretrained(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"tensor\(s\) no parameter .* 'model.layers.1"):
        from_pretrained(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(ValueError, match=r"down_proj.weight has shape \(32, 48\), the model's"):
        from_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match=r"no config\.json"):
        from_pretrained(tmp_path / "nothing")


def test_a_refused_save_writes_nothing(tmp_path):
    ref = _hf()
    ref.save_pretrained(tmp_path / "base")
    model = from_pretrained(tmp_path / "base")
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"q_proj is a LoRALinear.*merge_lora"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match=r"model must be a rudax\.models\.LlamaForCausalLM"):
        save_pretrained(object(), tmp_path / "out")  # type: ignore[arg-type]
    plain = from_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="holds a sharded checkpoint"):
        ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
        save_pretrained(plain, tmp_path / "sharded")
    assert isinstance(plain, LlamaForCausalLM)


def test_nf4_loading_quantizes_the_projections_as_nf4_quantize_does(tmp_path):
    import rudax.kernels as rk

    ref = _hf(tie=False, dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, quantize="nf4")
    q = model.model.layers[1].mlp.down_proj
    assert isinstance(q, rl.NF4Linear) and isinstance(model.model.norm, rl.RMSNorm)
    weight = ref.model.layers[1].mlp.down_proj.weight.detach()
    want = rk.nf4_quantize(jnp.asarray(weight.float().numpy(), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(q.codes[...]), np.asarray(want.codes))
    # the unquantized parts are the checkpoint's; the output is close to the bf16 model's
    plain = from_pretrained(tmp_path)
    np.testing.assert_array_equal(
        np.asarray(model.lm_head.embedding[...]), np.asarray(plain.lm_head.embedding[...])
    )
    a, b = (np.asarray(m(jnp.asarray(IDS)), np.float32) for m in (model, plain))
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
    # and QLoRA adapters train on top: the base is frozen, the NF4 layers stay NF4
    rl.apply_lora(model, ["q_proj", "down_proj"], rank=2, alpha=4, rngs=nnx.Rngs(0))
    assert isinstance(model.model.layers[0].self_attn.q_proj, rl.LoRALinear)
    with pytest.raises(ValueError, match="quantize must be one of"):
        from_pretrained(tmp_path, quantize="int8")


def test_nf4_loading_refuses_a_non_finite_projection_by_name(tmp_path):
    # Quantized, the NaN vanished on the CPU (the block's max dropped it): finite, wrong
    # outputs where the unquantized model gives NaN.
    ref = _hf(tie=False)
    with torch.no_grad():
        ref.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    ref.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds non-finite"
    ):
        from_pretrained(tmp_path, quantize="nf4")
    assert np.isnan(np.asarray(from_pretrained(tmp_path)(jnp.asarray(IDS)))).any()
