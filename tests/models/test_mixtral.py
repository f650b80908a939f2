"""rudax.models' Mixtral (a LlamaForCausalLM whose config has experts) against transformers'
MixtralForCausalLM: the files transformers writes are read, the files rudax writes are read
by transformers, and the logits, the load-balancing ``aux_loss``, the training loss and greedy
generation agree."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from rudax.models import (
    LlamaConfig,
    LlamaForCausalLM,
    causal_lm_loss_sum,
    from_pretrained,
    generate,
    save_pretrained,
)
from rudax.models._safetensors import SafetensorsFile
from tests.models._reference import hf_greedy

V = 96


def _hf_mixtral(**overrides):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        **overrides,
    )
    ref = transformers.MixtralForCausalLM._from_config(config, attn_implementation="eager")
    with torch.no_grad():  # a router with larger weights: top-2 choices well apart from ties
        for name, p in ref.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return ref.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A transformers-written tiny Mixtral folder and the model that wrote it."""
    ref = _hf_mixtral()
    folder = tmp_path_factory.mktemp("mixtral")
    ref.save_pretrained(folder)
    return ref, folder


def test_the_file_transformers_writes_is_read_with_its_expert_names(saved):
    _, folder = saved
    model = from_pretrained(folder)
    c = model.config
    assert (c.model_type, c.num_local_experts, c.num_experts_per_tok) == ("mixtral", 4, 2)
    moe = model.model.layers[1].block_sparse_moe
    assert moe.experts.w1.shape == (4, 32, 40) and moe.experts.w2.shape == (4, 40, 32)
    f = SafetensorsFile(folder / "model.safetensors")
    names = set(f.keys())
    want = f.get_tensor("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    gate = f.get_tensor("model.layers.1.block_sparse_moe.gate.weight")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    np.testing.assert_array_equal(np.asarray(moe.experts.w3[2]), want.T)
    np.testing.assert_array_equal(np.asarray(moe.gate.kernel[...]), gate.T)


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_logits_equal_transformers(saved, impl):
    ref, folder = saved
    model = from_pretrained(folder)
    model.set_moe_impl(impl)
    ids = np.random.default_rng(0).integers(0, V, (2, 24))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_aux_loss_and_training_loss_equal_transformers_with_padding(saved):
    ref, folder = saved
    model = from_pretrained(folder)
    rng = np.random.default_rng(1)
    ids = rng.integers(1, V, (2, 16))
    mask = np.ones((2, 16), np.int64)
    mask[1, 11:] = 0  # the second row is 11 tokens, right-padded
    labels = np.where(mask == 1, np.roll(ids, -1, axis=1), -100)
    labels[:, -1] = -100
    labels[1, 10] = -100  # the second row's last real token predicts nothing
    with torch.no_grad():
        out = ref(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            output_router_logits=True,
        )
    # transformers' loss over the same shifted labels, and its load-balancing term.
    logits = out.logits.float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), torch.tensor(labels).reshape(-1), ignore_index=-100
    )
    want_aux = float(out.aux_loss)
    batch = {"tokens": ids, "labels": labels, "segment_ids": mask}
    loss = jax.jit(causal_lm_loss_sum)
    _, metrics = loss(model, batch)
    np.testing.assert_allclose(float(metrics["aux_loss"]), want_aux, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["ce_sum"]) / int(metrics["tokens"]), float(ce),
                               rtol=1e-5)  # fmt: skip
    # With output_router_logits the loss adds coef * aux_loss, as transformers' loss does.
    model.config = LlamaConfig(**{**vars(model.config), "output_router_logits": True})
    total, metrics = loss(model, batch)
    want = float(ce) + model.config.router_aux_loss_coef * want_aux
    np.testing.assert_allclose(float(total) / int(metrics["tokens"]), want, rtol=1e-5)


def test_scanned_layers_give_the_loops_loss_and_gradients(saved):
    _, folder = saved
    model = from_pretrained(folder)
    ids = np.random.default_rng(2).integers(0, V, (2, 12))
    batch = {"tokens": ids, "labels": np.roll(ids, -1, axis=1)}

    def loss_and_grads(scan):
        model.scan_layers, model.remat = scan, "full" if scan else "none"  # stacks in place
        graph, params = nnx.split(model)
        f = lambda p: causal_lm_loss_sum(nnx.merge(graph, p), batch)[0]
        return jax.jit(jax.value_and_grad(f))(params)

    (loop, g_loop), (scan, g_scan) = loss_and_grads(False), loss_and_grads(True)
    np.testing.assert_allclose(float(scan), float(loop), rtol=1e-6)
    stacked = dict(nnx.to_flat_state(g_scan))  # layer i of a stacked leaf is its slice i
    for path, want in nnx.to_flat_state(g_loop):
        layer = path[:2] == ("model", "layers")
        got = stacked[(*path[:2], *path[3:])][path[2]] if layer else stacked[path]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-7)
    w2 = g_loop["model"]["layers"][0]["block_sparse_moe"]["experts"]["w2"][...]
    assert float(jnp.abs(w2).max()) > 0  # the experts learn


@pytest.mark.parametrize("scan", [False, True], ids=["per-layer", "stacked"])
def test_the_files_rudax_writes_load_in_transformers_with_equal_logits(saved, tmp_path, scan):
    ref, folder = saved
    model = from_pretrained(folder)
    # stored stacked, each expert tensor is a slice of a [layers, experts, in, out] leaf
    model.scan_layers = scan
    save_pretrained(model, tmp_path / "out")
    theirs = SafetensorsFile(folder / "model.safetensors").keys()
    ours = SafetensorsFile(tmp_path / "out" / "model.safetensors").keys()
    assert set(ours) == set(theirs)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    ids = torch.tensor(np.random.default_rng(3).integers(0, V, (1, 20)))
    with torch.no_grad():
        np.testing.assert_array_equal(back(ids).logits.numpy(), ref(ids).logits.numpy())


def test_greedy_generation_equals_transformers_for_64_tokens(saved):
    ref, folder = saved
    model = from_pretrained(folder)
    prompts = [[5, 17, 3, 90, 4, 8, 1], [7, 2]]
    got = generate(model, prompts, 64, stop_tokens=[])
    for prompt, row in zip(prompts, got, strict=True):
        assert row == hf_greedy(ref, prompt, 64), prompt


def test_an_nf4_base_quantizes_attention_and_keeps_the_experts(saved):
    ref, folder = saved
    model = from_pretrained(folder, quantize="nf4")
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "NF4Linear"
    assert layer.block_sparse_moe.experts.w1.dtype == jnp.float32
    ids = np.random.default_rng(4).integers(0, V, (1, 16))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    # NF4's 4-bit attention weights: close to the full model, not equal
    assert 0 < np.abs(got - want).max() <= 0.1 * np.abs(want).max()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        ({"num_local_experts": None}, "num_local_experts is missing"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be <= num_local_experts=4"),
    ],
)
def test_a_config_rudax_cannot_compute_is_refused_by_name(saved, change, match):
    _, folder = saved
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf({**hf, **change})


def test_experts_belong_to_mixtral_only():
    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="model_type='llama' with num_local_experts=4"):
        LlamaConfig(**common, num_local_experts=4)
    with pytest.raises(ValueError, match="model_type='mixtral' with num_local_experts=None"):
        LlamaConfig(**common, model_type="mixtral")
    model = LlamaForCausalLM(
        LlamaConfig(**common, model_type="mixtral", num_local_experts=3), rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match="impl must be one of"):
        model.set_moe_impl("megablocks")
