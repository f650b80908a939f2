"""LoRA on a Hugging Face Llama read by from_pretrained, rudax against transformers + peft (CPU).

Tiny random ``LlamaForCausalLM`` checkpoints are made here with transformers (nothing is
downloaded) and read by ``rudax.models.from_pretrained``, whose module paths are transformers'
names: ``apply_lora``, ``save_adapter``, ``load_adapter`` and ``merge_lora`` need no ``names=``.
In both directions: an adapter trained in rudax and written by ``save_adapter`` loads in
``peft.PeftModel.from_pretrained`` with rudax's logits, and one that peft initialised and saved
loads into a bare rudax model with peft's. ``merge_lora`` + ``save_pretrained`` equals peft's
``merge_and_unload``, LoRA on ``q_proj`` alone changes q's output only, the FSDP model computes
the one-device loss and adapter gradients (and peft's, in float64), and training the adapters
alone leaves every other parameter bit for bit as it was. Logits agree to max |difference| /
max |logit| <= 1e-5; each assert gives what was measured.
"""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from peft.tuners.lora import LoraLayer

import rudax.layers as rl
import rudax.optim as ro
import rudax.sharding as rs
from rudax.models import LlamaForCausalLM, causal_lm_loss_sum, from_pretrained, save_pretrained
from rudax.models import shard as shard_model
from tests.models._reference import TINY as BASE
from tests.models._reference import T, V
from tests.models._reference import ours as _ours
from tests.models._reference import rel_err as _rel_err
from tests.models._reference import theirs as _theirs

_ROWS = np.random.default_rng(1).integers(0, V, size=(8, T + 1), dtype=np.int32)
BATCH = {"tokens": _ROWS[:, :-1], "labels": _ROWS[:, 1:]}
KINDS = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# alpha / rank = 2, a power of two: scaling is exact in fp32, so rudax's order (scale the
# rank-sized product) and peft's (scale the output) round alike.
RANK, ALPHA = 4, 8.0
TOL = 1e-5


def _hf(directory):
    """The transformers model of a checkpoint directory, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def _peft_adapted(peft_model):
    """The names of the modules peft put a LoRA layer on."""
    return {n for n, m in peft_model.base_model.model.named_modules() if isinstance(m, LoraLayer)}


def _name(path):
    return ".".join(map(str, path))


def _loras(model):
    """{module path, transformers' name: LoRALinear} of a rudax model."""
    return {
        _name(path): node for path, node in nnx.iter_graph(model) if isinstance(node, rl.LoRALinear)
    }


def _flat(model):
    """{nnx path: (variable type, a NumPy copy of its value)} of every variable of model."""
    return {
        path: (type(var), np.array(var.get_value()))
        for path, var in nnx.to_flat_state(nnx.state(model))
    }


def _expected_names(targets, n_layers=2):
    where = {p: ("self_attn" if p[0] in "qkvo" else "mlp") for p in SEVEN}
    return sorted(f"model.layers.{i}.{where[t]}.{t}" for i in range(n_layers) for t in targets)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{kind: directory} of tiny random Llama checkpoints written by save_pretrained."""
    out = {}
    for seed, (kind, overrides) in enumerate(KINDS.items()):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, **overrides))
        with torch.no_grad():  # random norms: their init is ones, which would hide a mix-up
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.2 * torch.randn_like(p))
        out[kind] = tmp_path_factory.mktemp(kind)
        model.save_pretrained(out[kind])
    return out


def _train_adapters(model, steps=3):
    """AdamW (weight decay on) on the adapters alone, the functional split of rudax.layers."""
    graph, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    tx = ro.adamw(3e-2, weight_decay=0.1)

    @jax.jit
    def step(adapters, rest, opt_state):
        loss = lambda a: causal_lm_loss_sum(nnx.merge(graph, a, rest), BATCH)[0]
        updates, opt_state = tx.update(jax.grad(loss)(adapters), opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state

    opt_state = tx.init(adapters)
    for _ in range(steps):
        adapters, opt_state = step(adapters, rest, opt_state)
    nnx.update(model, adapters)


@dataclasses.dataclass
class Trained:
    directory: Path  # the base checkpoint
    targets: list[str]
    model: LlamaForCausalLM  # from_pretrained's, LoRA on targets, trained
    names: list[str]  # the adapted module names
    before: dict  # _flat(model) after apply_lora, before training
    adapter: Path  # save_adapter's directory


@pytest.fixture(
    scope="module",
    params=[("gqa-untied", ["q_proj", "v_proj"]), ("mqa-tied", SEVEN)],
    ids=["gqa-untied-qv", "mqa-tied-all7"],
)
def trained(request, bases, tmp_path_factory):
    """A from_pretrained model with LoRA on targets, trained 3 steps here, save_adapter'd."""
    kind, targets = request.param
    # Module fixtures run outside the suite's per-test strict promotion: enter it here.
    with jax.numpy_dtype_promotion("strict"):
        model = from_pretrained(bases[kind])
        names = rl.apply_lora(model, targets, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(1))
        before = _flat(model)
        _train_adapters(model)
        adapter = tmp_path_factory.mktemp("adapter")
        saved = rl.save_adapter(model, adapter, base_model_name_or_path=str(bases[kind]))
    assert names == saved == _expected_names(targets)
    return Trained(bases[kind], targets, model, names, before, adapter)


# ------------------------------------------------------------------------- rudax -> peft


def test_a_rudax_trained_adapter_loads_in_peft_with_the_same_logits(trained):
    loras = _loras(trained.model)
    assert sorted(loras) == trained.names
    for name, lora in loras.items():
        assert np.abs(lora.lora_b[...]).max() > 1e-3, name  # trained: B is no longer zero
    config = json.loads((trained.adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(trained.targets)  # peft's short names
    peft_model = peft.PeftModel.from_pretrained(_hf(trained.directory), trained.adapter).eval()
    assert _peft_adapted(peft_model) == set(trained.names)
    want = _theirs(peft_model)
    assert _rel_err(_ours(trained.model), want) <= TOL  # measured 9e-7 (q, v), 1.6e-6 (all 7)
    # The adapters matter at this tolerance: the base alone is far from the adapted logits.
    assert _rel_err(_theirs(_hf(trained.directory)), want) > 1e-3


def test_training_the_adapters_alone_leaves_every_other_parameter_bit_identical(trained):
    after = _flat(trained.model)
    assert after.keys() == trained.before.keys()
    adapters = {p for p, (kind, _) in after.items() if kind is rl.LoRAParam}
    assert adapters == {
        path
        for path, node in nnx.iter_graph(trained.model)
        if isinstance(node, rl.LoRALinear)
        for path in ((*path, "lora_a"), (*path, "lora_b"))
    }
    kinds = {kind for p, (kind, _) in after.items() if p not in adapters}
    assert kinds == {nnx.Param, rl.Frozen}  # norms, embeddings, unadapted layers; the bases
    for path, (kind, value) in after.items():
        old_kind, old = trained.before[path]
        assert kind is old_kind
        if path in adapters:  # A by AdamW and its weight decay, B from zero
            assert not np.array_equal(value, old), path
        else:
            assert value.dtype == old.dtype and np.array_equal(value, old), path


def test_merge_lora_and_save_pretrained_equal_peft_merge_and_unload(trained, tmp_path):
    peft_model = peft.PeftModel.from_pretrained(_hf(trained.directory), trained.adapter)
    theirs = peft_model.merge_and_unload().eval()
    merged = nnx.clone(trained.model)
    assert rl.merge_lora(merged) == trained.names
    assert not _loras(merged) and sorted(_loras(trained.model)) == trained.names
    save_pretrained(merged, tmp_path)
    reloaded = _hf(tmp_path)
    ours_sd, theirs_sd = reloaded.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    base_sd = _hf(trained.directory).state_dict()
    adapted = {f"{name}.weight" for name in trained.names}
    for key, want in theirs_sd.items():
        got, want = ours_sd[key].numpy(), want.numpy()
        if key in adapted:
            # Both are fl(W + 2 * sum_k a_k b_k) over rank 4 in fp32: another summation order
            # moves the sum by <= 6u sum|2 a_k b_k| (u = 2^-24), then one rounding of the
            # result; 4 ulp of max |W'| bounds both. Measured: bit for bit.
            np.testing.assert_allclose(
                got, want, rtol=0, atol=4 * np.spacing(np.abs(want).max()), err_msg=key
            )
            assert not np.array_equal(got, base_sd[key].numpy()), key
        else:
            np.testing.assert_array_equal(got, want, err_msg=key)
    want = _theirs(theirs)
    assert _rel_err(_ours(merged), want) <= TOL  # measured 1.1e-6 (q, v), 1.3e-6 (all 7)
    assert _rel_err(_theirs(reloaded), want) <= TOL  # the same weights: measured 0
    assert _rel_err(_ours(merged), _ours(trained.model)) <= TOL  # folded, the same function


# ------------------------------------------------------------------------- peft -> rudax


def _peft_initialised(directory, targets, out, *, dropout=0.0, seed=3):
    """get_peft_model on the transformers base, B set non-zero (as trained), save_pretrained."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=int(ALPHA),
        target_modules=targets,
        lora_dropout=dropout,
        task_type="CAUSAL_LM",
    )
    peft_model = peft.get_peft_model(_hf(directory), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in peft_model.modules():
            if isinstance(m, LoraLayer):
                b = m.lora_B["default"].weight
                assert not b.any()  # peft's init: B = 0
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    peft_model.save_pretrained(out)
    return peft_model.eval()


def test_a_peft_initialised_adapter_loads_into_a_bare_rudax_model(bases, tmp_path):
    # The other base and layer set than the rudax-trained mqa-tied-all7 case; peft's usual
    # lora_dropout, off in eval mode on both sides.
    directory = bases["gqa-untied"]
    peft_model = _peft_initialised(directory, SEVEN, tmp_path, dropout=0.1)
    model = from_pretrained(directory)
    names = rl.load_adapter(model, tmp_path)
    assert names == sorted(_peft_adapted(peft_model)) == _expected_names(SEVEN)
    for lora in _loras(model).values():
        assert (lora.rank, lora.scale, lora.dropout.rate) == (RANK, ALPHA / RANK, 0.1)
    model.eval()
    want = _theirs(peft_model)
    assert _rel_err(_ours(model), want) <= TOL  # measured 2.3e-6
    assert _rel_err(_theirs(_hf(directory)), want) > 1e-3


# ------------------------------------------------------------------------- q_proj alone


def test_lora_on_q_proj_alone_changes_the_q_projection_only(bases, tmp_path):
    directory = bases["gqa-untied"]
    peft_model = _peft_initialised(directory, ["q_proj"], tmp_path)
    model, bare = from_pretrained(directory), from_pretrained(directory)
    assert rl.load_adapter(model, tmp_path) == _expected_names(["q_proj"])
    # Every projection's input and output in peft's model, layer by layer.
    seen = {}
    hooks = [
        module.register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out))
        )
        for name, module in peft_model.base_model.model.named_modules()
        if re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qkv]_proj", name)
    ]
    want = _theirs(peft_model)
    for hook in hooks:
        hook.remove()
    assert _rel_err(_ours(model), want) <= TOL  # measured 1.4e-6
    project = nnx.jit(lambda layer, x: layer(x))
    for i in range(2):
        attn, bare_attn = model.model.layers[i].self_attn, bare.model.layers[i].self_attn
        for proj in ("q_proj", "k_proj", "v_proj"):
            x, out = seen[f"model.layers.{i}.self_attn.{proj}"]
            x = jnp.asarray(x.numpy())
            got = np.asarray(project(getattr(attn, proj), x), np.float64)
            plain = np.asarray(project(getattr(bare_attn, proj), x), np.float64)
            # One matmul of 32 (+ rank 4) fp32 terms, not 2 layers of them: measured 9e-8.
            assert _rel_err(got, out.double().numpy()) <= 1e-6, (i, proj)
            if proj == "q_proj":
                assert _rel_err(plain, got) > 1e-2  # the adapter moves q
            else:  # the same layer as the bare model's: bit for bit
                assert type(getattr(attn, proj)) is rl.Linear
                np.testing.assert_array_equal(got, plain)


# --------------------------------------------------------------------------------- FSDP

N = 8


def _peft_gradients(directory, adapter, rows):
    """peft's float64 gradients of the summed cross entropy: {name: (dA [in, r], dB [r, out])}."""
    peft_model = peft.PeftModel.from_pretrained(_hf(directory), adapter, is_trainable=True)
    peft_model = peft_model.double()
    rows = torch.tensor(rows.astype(np.int64))
    logits = peft_model(rows[:, :-1]).logits
    torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"
    ).backward()
    return {
        name: (m.lora_A["default"].weight.grad.numpy().T, m.lora_B["default"].weight.grad.numpy().T)
        for name, m in peft_model.base_model.model.named_modules()
        if isinstance(m, LoraLayer)
    }


@pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")
def test_the_sharded_lora_model_gives_the_one_device_loss_and_adapter_gradients(bases, tmp_path):
    # An Explicit mesh, jax.make_mesh's; tests/models/test_shard.py runs an Auto one.
    mesh = jax.make_mesh((N,), ("fsdp",), devices=jax.devices()[:N])
    model = from_pretrained(bases["gqa-untied"])
    rl.apply_lora(model, SEVEN, rank=RANK, alpha=ALPHA, rngs=nnx.Rngs(1))
    g = np.random.default_rng(2)
    for lora in _loras(model).values():  # B as after training: A's gradient is non-zero
        lora.lora_b[...] = jnp.asarray(0.3 * g.standard_normal(lora.lora_b.shape), jnp.float32)

    ref_graph, ref_adapters, ref_rest = nnx.split(model, rl.LoRAParam, ...)
    ref = lambda a: causal_lm_loss_sum(nnx.merge(ref_graph, a, ref_rest), BATCH)[0]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref))(ref_adapters)

    sharded = shard_model(model, rs.ShardingContext(mesh, "fsdp"))
    graph, adapters, rest = nnx.split(sharded, rl.LoRAParam, ...)
    assert len(jax.tree.leaves(adapters)) == len(jax.tree.leaves(ref_adapters)) == 2 * 14
    # Each rank's loss is of its own row; their sum is the loss of the whole batch.
    local = lambda a, r, b: jax.lax.psum(causal_lm_loss_sum(nnx.merge(graph, a, r), b)[0], "fsdp")
    total = jax.shard_map(local, mesh=mesh, in_specs=P("fsdp"), out_specs=P())
    placed = jax.device_put(BATCH, NamedSharding(mesh, P("fsdp")))
    loss, grads = jax.jit(jax.value_and_grad(total))(adapters, rest, placed)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)

    nnx.update(sharded, grads)
    got = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                if isinstance(var, rl.LoRAParam):
                    got[(*prefix, *path)] = var.get_value().unshard()
    want = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(ref_grads)}
    assert got.keys() == want.keys()
    # Both against peft's float64 gradients too: the one-device ones are not the truth either.
    rl.save_adapter(model, tmp_path, base_model_name_or_path=None)
    exact = _peft_gradients(bases["gqa-untied"], tmp_path, _ROWS)
    for path, value in want.items():
        truth = exact[_name(path[:-1])][path[-1] == "lora_b"]
        assert np.abs(truth).max() > 0, path
        # fp32 sums over 128 tokens in two orders, per rank then reduce-scattered or whole:
        # measured at most 5.2e-6 apart, and 6.5e-6 (one device), 3.8e-6 (FSDP) from float64.
        assert _rel_err(got[path], value) <= TOL, path
        assert _rel_err(value, truth) <= TOL, path
        assert _rel_err(got[path], truth) <= TOL, path
