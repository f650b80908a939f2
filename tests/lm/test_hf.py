"""examples/lm/hf.py against transformers itself: tiny random Llama/Qwen2 models made here.

Every model is built locally with transformers (nothing downloaded), saved with its own
``save_pretrained``, and compared in fp32 on the same token ids: ``load_hf``'s logits against
transformers' (max |difference| / max |logit| <= 1e-5), and a GPT trained a few steps here,
written by ``save_hf``, against what ``AutoModelForCausalLM.from_pretrained`` computes.
"""

import dataclasses
import doctest
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch  # the reference extra: required, never skipped (the tests run in CI)
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import examples.lm.hf as hf_lib
import examples.lm.hf_config as hf_config
import rudax.layers as rl
import rudax.optim as ro
import rudax.sharding as rs
from examples.lm import train
from examples.lm.config import build_parser
from examples.lm.hf import config_from_hf, hf_module_name, load_hf, save_hf
from examples.lm.model import GPT, GPTConfig, loss_sum, shard
from examples.lm.prepare import open_split
from tests.lm.conftest import TINY

V, T = 64, 16
IDS = np.random.default_rng(0).integers(0, V, size=(2, T))
# Small enough to build, save and compile in well under a second each.
BASE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=T,
    # 15x transformers' default std: scores of a few units, so attention depends on position
    # (RoPE) far more than at a real init's near-uniform attention.
    initializer_range=0.3,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # head_dim 8 at theta 5e5: wavelengths 6.3, 167, 4.4e3, 1.2e5 against L / 4 = 64 and
    # L / 1 = 256: one kept, one blended, two divided; every branch of the rewrite is used.
    original_max_position_embeddings=256,
)

_logits = nnx.jit(lambda model, ids: model(ids)[0])


def _ours(model):
    return np.asarray(_logits(model, jnp.asarray(IDS, jnp.int32)), np.float64)


def _theirs(hf_model):
    with torch.no_grad():
        return hf_model(torch.tensor(IDS)).logits.double().numpy()


def _rel_err(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _hf_model(kind="llama", seed=0, **overrides):
    """A random transformers model with random norms and biases (their init is ones/zeros)."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **overrides}))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**BASE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


# ------------------------------------------------------------------------------- load_hf


def _v4_spelling(directory):
    """Rewrites a v5 config.json as transformers v4 wrote it: rope_theta + rope_scaling."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("kind", "overrides", "save_kw"),
    [
        ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False), {}),
        ("llama", dict(tie_word_embeddings=True), {}),  # multi-head attention, tied head
        ("llama", dict(num_key_value_heads=1), dict(max_shard_size="20KB")),  # 5 shards
        ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3), {}),
        ("llama", dict(num_key_value_heads=2, rope_parameters=LLAMA3), "v4"),
        ("qwen2", dict(num_key_value_heads=2), {}),  # q/k/v biases
    ],
    ids=["gqa-untied", "mha-tied", "mqa-sharded", "llama3-rope", "llama3-rope-v4", "qwen2"],
)
def test_load_hf_logits_equal_transformers(tmp_path, kind, overrides, save_kw):
    if "rope_parameters" in overrides:  # L = 256 < the context, as transformers requires
        overrides = {**overrides, "max_position_embeddings": 1024}
    hf_model = _hf_model(kind, **overrides)
    hf_model.save_pretrained(tmp_path, **(save_kw if isinstance(save_kw, dict) else {}))
    if save_kw == "v4":
        _v4_spelling(tmp_path)
    if "max_shard_size" in save_kw:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_hf(tmp_path)
    c = model.config
    assert c.param_dtype == np.float32 and c.dtype == np.float32 and not c.fused_qkv
    assert c.n_kv_heads == overrides.get("num_key_value_heads", 4)
    assert c.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert c.qkv_bias == (kind == "qwen2")
    assert (c.rope_scaling is not None) == ("rope_parameters" in overrides)
    want = _theirs(hf_model)
    assert _rel_err(_ours(model), want) <= 1e-5
    if c.rope_scaling is not None:
        # The rewrite matters at these shapes: plain RoPE's logits are far from transformers'.
        plain = nnx.merge(
            nnx.graphdef(GPT(dataclasses.replace(c, rope_scaling=None), rngs=nnx.Rngs(0))),
            nnx.state(model),
        )
        assert _rel_err(_ours(plain), want) > 1e-3


def test_bf16_checkpoint_loads_for_fp32_compute(tmp_path):
    hf_model = _hf_model(num_key_value_heads=2).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    model = load_hf(tmp_path, param_dtype=jnp.float32)  # bf16 -> fp32 is exact
    assert model.config.dtype == np.float32
    assert model.blocks[0].attn.q.kernel.dtype == jnp.float32
    # Read back by transformers in fp32, not hf_model.float(): .to(bfloat16) also rounded the
    # model's RoPE inv_freq buffer, which a fresh load recomputes in fp32.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _rel_err(_ours(model), _theirs(reference.eval())) <= 1e-5
    stored = load_hf(tmp_path)  # the checkpoint's own dtype
    assert stored.config.param_dtype == jnp.bfloat16 and stored.config.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(stored.embed.embedding.get_value(), np.float32),
        hf_model.model.embed_tokens.weight.float().detach().numpy(),
    )


def test_hf_module_name_gives_transformers_module_names(tmp_path):
    hf_model = _hf_model(num_key_value_heads=2, tie_word_embeddings=False)
    hf_model.save_pretrained(tmp_path)
    kinds = (
        torch.nn.Linear,
        torch.nn.Embedding,
        transformers.models.llama.modeling_llama.LlamaRMSNorm,
    )
    theirs = {name for name, m in hf_model.named_modules() if isinstance(m, kinds)}
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    leaf_modules = (rl.Linear, rl.Embedding, rl.RMSNorm, rl.TiedProjection)
    ours = {
        hf_module_name(path)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, leaf_modules)
    }
    assert ours == theirs
    # Containers have their names too; what HF does not have is None.
    assert hf_module_name(("blocks", 1, "attn")) == "model.layers.1.self_attn"
    assert hf_module_name(("blocks", 1)) == "model.layers.1"
    assert hf_module_name(()) is None
    assert hf_module_name(("blocks", 0, "attn", "q", "base")) is None
    assert hf_module_name(("blocks", 0, "attn", "qkv")) is None


# ------------------------------------------------------------------------------- save_hf


def _train_a_few_steps(config, steps=3):
    """A GPT trained here with AdamW on a repeated batch: no parameter at its init value."""
    model = GPT(config, rngs=nnx.Rngs(1))
    graph, params = nnx.split(model)
    tx = ro.adamw(3e-2)
    batch = np.random.default_rng(1).integers(0, V, size=(4, T + 1), dtype=np.int32)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(lambda p: loss_sum(nnx.merge(graph, p), batch)[0])(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return nnx.merge(graph, params)


_F32 = dict(vocab_size=V, seq_len=T, d_model=32, n_layers=2, n_heads=4, mlp_hidden=48)


@pytest.mark.parametrize(
    "overrides",
    [
        # The trainer's layout (fused qkv, tied head), with GQA and Llama 3's RoPE.
        dict(n_kv_heads=2, rope_scaling=rl.Llama3RopeScaling(8.0, 1.0, 4.0, 8), seq_len=32),
        dict(n_kv_heads=2, fused_qkv=False, tie_embeddings=False, qkv_bias=True),  # Qwen2
    ],
    ids=["fused-tied-llama3", "separate-untied-biases"],
)
def test_save_hf_of_a_trained_gpt_loads_in_transformers(tmp_path, overrides):
    config = GPTConfig(**{**_F32, **overrides}, param_dtype=jnp.float32, dtype=jnp.float32)
    model = _train_a_few_steps(config)
    save_hf(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    want = "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"
    assert type(hf_model).__name__ == want and hf_model.dtype == torch.float32
    assert _rel_err(_ours(model), _theirs(hf_model)) <= 1e-5
    # Config round trip: load_hf builds the same model, with separate q/k/v projections.
    loaded = load_hf(tmp_path)
    assert loaded.config == dataclasses.replace(config, fused_qkv=False)
    assert _rel_err(_ours(loaded), _ours(model)) <= 1e-6


def test_save_hf_then_load_hf_is_bit_exact_in_bf16(tmp_path):
    config = GPTConfig(**_F32, n_kv_heads=2, tie_embeddings=False)  # bf16 storage
    model = GPT(config, rngs=nnx.Rngs(2))
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text('{"model": "a tokenizer"}')
    save_hf(model, tmp_path / "out", tokenizer=tokenizer, eos_token_id=7)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert written["eos_token_id"] == 7
    loaded = load_hf(tmp_path / "out")
    assert loaded.config == dataclasses.replace(config, fused_qkv=False)
    ours = dict(nnx.to_flat_state(nnx.state(model)))
    for path, var in nnx.to_flat_state(nnx.state(loaded)):
        if path[-2] in ("q", "k", "v"):  # the column blocks of the fused kernel
            fused = np.asarray(ours[(*path[:-2], "qkv", "kernel")].get_value())
            start = {"q": 0, "k": 32, "v": 48}[path[-2]]
            want = fused[:, start : start + var.get_value().shape[1]]
        else:
            want = np.asarray(ours[path].get_value())
        got = np.asarray(var.get_value())
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want, err_msg=str(path))


# ------------------------------------------------------------------------------- export


# FSDP only, to spare CI a second tiny run: its export reads the flat shards back whole, the
# one-device export is that path without the unsharding, and conftest's exported_run (used by
# test_hf_init.py and test_lora_script.py) exports a one-device run whose weights they check.
@pytest.mark.parametrize("mesh", ["fsdp=8"])
def test_export_cli_gives_transformers_the_runs_weights_and_tokenizer(data, tmp_path, mesh):
    """The exported model computes the run's last validation loss, in transformers."""
    if mesh and jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    run, out = tmp_path / "run", tmp_path / "hf"
    f32 = ["--param-dtype", "float32", "--compute-dtype", "float32", "--optimizer", "adamw"]
    short = ["--steps", "3", "--eval-every", "3", "--checkpoint-every", "2"]
    summary = train.main(
        [*data, *TINY, *short, *f32, "--run-dir", str(run), *(["--mesh", mesh] if mesh else [])]
    )
    result = hf_lib.main(["export", str(run), str(out)])
    assert result["step"] == 3  # the latest checkpoint: the weights validated last
    data_dir = Path(data[data.index("--data-dir") + 1])
    assert (out / "tokenizer.json").read_bytes() == (data_dir / "tokenizer.json").read_bytes()
    eot = json.loads((data_dir / "prepared.json").read_text())["eot_id"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eot
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.dtype == torch.float32
    ce, n = 0.0, 0
    loader = open_split(data_dir, "val", seq_len=16, batch_size=8, seed=0)
    for batch in loader.eval_batches(2):  # TINY's --seq-len, --batch-size, --eval-batches
        batch = torch.tensor(batch.astype(np.int64))
        with torch.no_grad():
            logits = hf_model(batch[:, :-1]).logits.double()
        ce += float(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
            )
        )
        n += batch[:, 1:].numel()
    np.testing.assert_allclose(ce / n, summary["val_loss"], rtol=1e-5)


def test_export_cli_errors_name_the_problem(data, tmp_path, capsys):
    def error(run_dir):
        with pytest.raises(SystemExit) as e:
            hf_lib.main(["export", str(run_dir), str(tmp_path / "out")])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "holds no run (no config.json)" in error(tmp_path / "nothing")
    run = tmp_path / "run"
    run.mkdir()
    write_flags = lambda *flags: (run / "config.json").write_text(
        json.dumps(vars(build_parser().parse_args([*data, *TINY, *flags])))
    )
    write_flags("--data-dir", str(tmp_path / "no-data"))
    assert "the run's data directory" in error(run)
    write_flags()
    assert "has no checkpoints/ directory" in error(run)
    write_flags("--moe")
    assert "num_experts=4: a Llama-format checkpoint has no mixture-of-experts" in error(run)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------- errors

_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    dtype="float32",
)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(architectures=["MistralForCausalLM"]), r"architectures=\['MistralForCausalLM'\]"),
        (dict(model_type="mistral"), "the causal LM of model_type='mistral'"),
        (dict(quantization_config={"bits": 4}), "quantization_config=.* does not implement"),
        (dict(sliding_window=8), "sliding_window=8 is a field rudax.models does not implement"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (dict(mlp_bias=True), "mlp_bias=True is not supported"),
        (dict(head_dim=16), "head_dim=16 is not supported.* 8 wide"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
        (
            dict(num_key_value_heads=3),
            "config.json: num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        (dict(hidden_size=None), "hidden_size is missing"),
        (dict(dtype=None), "no dtype or torch_dtype field: pass param_dtype"),
        (dict(dtype="float64"), "dtype='float64' is not supported"),
        (dict(torch_dtype="bfloat16"), "dtype and torch_dtype disagree"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            "rope_type='yarn' is not implemented",
        ),
        (
            dict(rope_scaling={"type": "linear", "factor": 2.0}),
            "rope_type='linear' is not implemented",
        ),
        (
            dict(rope_parameters={**LLAMA3, "mscale": 1.0}),
            "rope field mscale=1.0 is not implemented",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
            "llama3' needs low_freq_factor",
        ),
        (
            dict(rope_parameters={**LLAMA3, "high_freq_factor": 0.5}),
            "high_freq_factor must be > low_freq_factor",
        ),
        (
            dict(rope_theta=10.0, rope_parameters={"rope_theta": 20.0}),
            "rope_theta=10.0 but rope_parameters has rope_theta=20.0",
        ),
        (
            dict(rope_scaling={**LLAMA3}, rope_parameters={**LLAMA3, "factor": 4.0}),
            "disagree on factor",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5 is not supported",
        ),
    ],
)
def test_unsupported_config_fields_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**_LLAMA, **overrides})


def test_absent_fields_take_transformers_defaults():
    config = config_from_hf(_LLAMA)
    assert (config.n_kv_heads, config.seq_len, config.norm_eps) == (4, 2048, 1e-6)
    assert (config.rope_theta, config.rope_scaling, config.tie_embeddings) == (10000.0, None, False)
    # Llama 3's original context defaults to max_position_embeddings, v4's "type" key works.
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = config_from_hf({**_LLAMA, "max_position_embeddings": 512, "rope_scaling": scaling})
    assert config.rope_scaling == rl.Llama3RopeScaling(8.0, 1.0, 4.0, 512)
    assert config_from_hf(_LLAMA, param_dtype="bfloat16").dtype == jnp.bfloat16


def test_qwen2_sliding_window_is_refused_and_its_off_fields_accepted():
    qwen = {**_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    off = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
    assert config_from_hf({**qwen, **off}).qkv_bias
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        config_from_hf({**qwen, **off, "use_sliding_window": True})
    with pytest.raises(ValueError, match=r"layer_types=.*sliding_attention"):
        config_from_hf({**qwen, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match=r"attention_bias=.* rudax.models does not implement"):
        config_from_hf({**qwen, "attention_bias": True})  # not a Qwen2 field


def _rewrite(directory, tensors, change):
    """Writes model.safetensors as tensors (a dict, not modified) with change applied."""
    tensors = dict(tensors)
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def saved(tmp_path):
    """A tiny tied GQA GPT in HF format, written by save_hf: (directory, model)."""
    config = GPTConfig(
        **{**_F32, "n_layers": 1}, n_kv_heads=2, param_dtype=jnp.float32, dtype=jnp.float32
    )
    model = GPT(config, rngs=nnx.Rngs(0))
    save_hf(model, tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def test_bad_tensors_are_named(saved):
    directory, model = saved
    embed = np.asarray(model.embed.embedding.get_value())
    q = "model.layers.0.self_attn.q_proj.weight"
    # Redundant tensors that agree are accepted: a tied lm_head, RoPE's inv_freq buffer.
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    freqs = (10000.0 ** (-np.arange(0, 8, 2) / 8)).astype(np.float32)
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors.update({"lm_head.weight": embed, inv_freq: freqs})
    _rewrite(directory, tensors, lambda t: None)
    assert _rel_err(_ours(load_hf(directory)), _ours(model)) <= 1e-6
    cases = [
        (lambda t: t.update({inv_freq: 2 * freqs}), "inv_freq holds other RoPE frequencies"),
        (lambda t: t.update({"lm_head.weight": embed + 1}), "lm_head.weight differs from"),
        (lambda t: t.pop(q), f"lacks {q} \\(1 missing in all\\)"),
        (lambda t: t.update(extra=embed), "has a tensor the GPT has no place for: extra"),
        (
            lambda t: t.update({q: t[q][:, :8]}),
            f"{q} has shape \\(32, 8\\); config.json makes it \\(32, 32\\)",
        ),
        (lambda t: t.update({q: t[q].astype(np.int32)}), "has dtype int32, not floating"),
    ]
    for change, match in cases:
        _rewrite(directory, tensors, change)
        with pytest.raises(ValueError, match=match):
            load_hf(directory)


def test_bad_files_are_named(saved, tmp_path):
    directory, _ = saved
    with pytest.raises(ValueError, match=r"no config.json"):
        load_hf(tmp_path)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"\['pytorch_model.bin'\]: rudax reads safetensors only"):
        load_hf(directory)
    (directory / "pytorch_model.bin").rename(directory / "model-1.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-2.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists model-2.safetensors, which is not a file in"):
        load_hf(directory)
    (directory / "model-1.safetensors").rename(directory / "model-2.safetensors")
    with pytest.raises(
        ValueError, match=r"holds model.layers.0.*which model.safetensors.index.json puts in None"
    ):
        load_hf(directory)
    (directory / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json: not JSON"):
        load_hf(directory)


def test_save_hf_refuses_what_has_no_hf_form(saved, tmp_path):
    directory, model = saved
    with pytest.raises(TypeError, match=r"model must be an examples.lm.model.GPT"):
        save_hf(model.blocks[0], tmp_path / "x")
    moe = GPT(GPTConfig(**_F32, num_experts=2, top_k=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_experts=2: a Llama-format checkpoint has no"):
        save_hf(moe, tmp_path / "x")
    separate = GPT(GPTConfig(**_F32, fused_qkv=False), rngs=nnx.Rngs(0))
    separate.blocks[1].attn.q = rl.LoRALinear(
        separate.blocks[1].attn.q, 2, alpha=4.0, rngs=nnx.Rngs(1)
    )
    with pytest.raises(TypeError, match=r"model.blocks\[1\].attn.q is a LoRALinear.*merge_lora"):
        save_hf(separate, tmp_path / "x")
    ctx = rs.ShardingContext(jax.sharding.Mesh(jax.devices()[:1], ("fsdp",)))
    with pytest.raises(TypeError, match=r"model.embed is a ShardedModule"):
        save_hf(shard(model, ctx), tmp_path / "x")
    with pytest.raises(ValueError, match=r"tokenizer='.*nope.json' is not a file"):
        save_hf(model, tmp_path / "x", tokenizer=tmp_path / "nope.json")
    (directory / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a sharded checkpoint"):
        save_hf(model, directory)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("module", [hf_lib, hf_config], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags)
    assert result.attempted > 0 and result.failed == 0


def test_token_id_fields_transformers_writes_are_accepted():
    # A real 135M checkpoint written by transformers 5 was refused over "unk_token_id": 0.
    ids = dict(unk_token_id=0, bos_token_id=0, eos_token_id=[0, 2], sep_token_id=None)
    assert config_from_hf({**_LLAMA, **ids}) == config_from_hf(_LLAMA)


def test_nf4_loading_refuses_a_non_finite_projection(saved):
    # nf4_quantize's block max drops a NaN on the CPU: quantized, the damage was invisible.
    directory, _ = saved
    q = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def poison(t):
        w = np.array(t[q])
        w[1, 2] = np.nan
        t[q] = w

    _rewrite(directory, tensors, poison)
    with pytest.raises(ValueError, match=rf"{q} holds non-finite values"):
        load_hf(directory, quantize="nf4")
