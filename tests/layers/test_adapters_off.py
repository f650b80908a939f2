"""rudax.layers.adapters_disabled: a LoRA model with its adapters off is its base, bit for bit
(LoRA, QLoRA, scanned layers), peft's ``disable_adapter()`` on the same weights; policy and
reference in one jitted step with the reference adding exactly nothing to the adapters'
gradients; the switch restored on exit, after an exception and when nested; no dropout key
drawn; a model without adapters refused; an FSDP model's adapters switched off through its
ShardedModules, policy and reference from one state in one shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from peft.tuners.lora import LoraLayer

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, from_pretrained, shard
from tests.models._reference import hf_model, ours, rel_err, theirs

V = 96
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 10)), jnp.int32)
_logits = nnx.jit(lambda model, ids: model(ids))


def _config():
    # NF4 quantizes 64-blocks: every projection's size a multiple of 64.
    return LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def _loras(model):
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, rl.LoRALinear)]


def _set_b(model, seed=7):
    """B non-zero, as after training: outside the block the adapters change the logits."""
    for i, lora in enumerate(_loras(model)):
        key = jax.random.fold_in(jax.random.key(seed), i)
        lora.lora_b.set_value(0.1 * jax.random.normal(key, lora.lora_b.shape))


def _base_and_adapted(kind, *, targets=SEVEN, dropout=0.0):
    """(the model before apply_lora, the same model with LoRA on targets and B non-zero).

    For QLoRA the base is the model with the same targets replaced by their NF4Linear (what
    apply_lora(quantize_base="nf4") wraps): the adapters' reference is the quantized base.
    """
    base = LlamaForCausalLM(_config(), rngs=nnx.Rngs(0))
    adapted = nnx.clone(base)
    quantize = "nf4" if kind == "qlora" else None
    rl.apply_lora(
        adapted, targets, rank=4, alpha=8.0, dropout=dropout, quantize_base=quantize,
        rngs=nnx.Rngs(1),
    )  # fmt: skip
    _set_b(adapted)
    if kind == "qlora":
        for layer in base.model.layers:
            for holder in (layer.self_attn, layer.mlp):
                for name in targets:
                    if hasattr(holder, name):
                        setattr(holder, name, rl.NF4Linear.from_linear(getattr(holder, name)))
    return base, adapted


# ------------------------------------------------------------------ the base, bit for bit


@pytest.mark.parametrize(("kind", "scan"), [("lora", False), ("qlora", False), ("lora", True)])
def test_inside_the_block_the_model_is_its_base_bit_for_bit(kind, scan):
    base, model = _base_and_adapted(kind)
    base.scan_layers = model.scan_layers = scan
    want = np.asarray(_logits(base, IDS))
    adapted = np.asarray(_logits(model, IDS))
    assert rel_err(adapted, want) > 1e-2  # the adapters matter
    with rl.adapters_disabled(model):
        assert not any(lora.adapter_enabled for lora in _loras(model))
        np.testing.assert_array_equal(np.asarray(_logits(model, IDS)), want)
    assert all(lora.adapter_enabled for lora in _loras(model))
    np.testing.assert_array_equal(np.asarray(_logits(model, IDS)), adapted)


def test_peft_disable_adapter_gives_the_same_logits(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "base")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B as after training (peft starts it at zero)
        for m in peft_model.modules():
            if isinstance(m, LoraLayer):
                b = m.lora_B["default"].weight
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    model = from_pretrained(tmp_path / "base")
    assert len(rl.load_adapter(model, tmp_path / "adapter")) == 2 * len(SEVEN)

    with peft_model.disable_adapter():
        want_off = theirs(peft_model)
    want_on = theirs(peft_model)
    with rl.adapters_disabled(model):
        got_off = ours(model)
    got_on = ours(model)
    assert rel_err(want_on, want_off) > 1e-3  # the adapters matter at this tolerance
    # Two fp32 programs of two layers: measured 1.2e-6 (off) and 1.2e-6 (on).
    assert rel_err(got_off, want_off) <= 1e-5
    assert rel_err(got_on, want_on) <= 1e-5


# --------------------------------------------------- policy and reference in one jitted step


def test_one_jitted_step_computes_both_and_the_reference_adds_no_gradient():
    base, model = _base_and_adapted("lora")
    weights = jax.random.normal(jax.random.key(1), (*IDS.shape, V))
    adapters_only = nnx.DiffState(0, rl.LoRAParam)

    @nnx.jit
    def step(model, ids):
        def terms(model):
            policy = model(ids)
            with rl.adapters_disabled(model):
                reference = model(ids)
            return jnp.sum(policy * weights), jnp.sum(reference * weights), policy, reference

        both = nnx.grad(lambda m: terms(m)[0] + terms(m)[1], argnums=adapters_only)(model)
        policy_only = nnx.grad(lambda m: terms(m)[0], argnums=adapters_only)(model)
        reference_only = nnx.grad(lambda m: terms(m)[1], argnums=adapters_only)(model)
        _, _, policy, reference = terms(model)
        return both, policy_only, reference_only, policy, reference

    both, policy_only, reference_only, policy, reference = step(model, IDS)
    assert all(lora.adapter_enabled for lora in _loras(model))  # restored inside the trace
    np.testing.assert_array_equal(np.asarray(policy), np.asarray(_logits(model, IDS)))
    # The base's computation in another program (fused with the policy's): fp32 rounding at
    # most; measured bit for bit.
    np.testing.assert_allclose(
        np.asarray(reference), np.asarray(_logits(base, IDS)), rtol=0, atol=1e-5
    )
    leaves = lambda s: jax.tree.leaves(s)
    assert len(leaves(both)) == 2 * 2 * len(SEVEN)
    for g in leaves(reference_only):  # the adapter branch is not in the reference's program
        assert not np.any(np.asarray(g))
    for a, b in zip(leaves(both), leaves(policy_only), strict=True):
        assert np.any(np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_once_merge_twice():
    """The functional step: one state, two graph definitions, one jax.jit program."""
    base, model = _base_and_adapted("lora")
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    with rl.adapters_disabled(model):
        reference_graphdef, *_ = nnx.split(model, rl.LoRAParam, ...)
    assert reference_graphdef != graphdef  # the switch is in the graph definition

    @jax.jit
    def step(adapters, rest, ids):
        def log_ratio(a):
            policy = jax.nn.log_softmax(nnx.merge(graphdef, a, rest)(ids))
            reference = jax.nn.log_softmax(nnx.merge(reference_graphdef, a, rest)(ids))
            return jnp.sum(policy - reference), reference

        return jax.grad(log_ratio, has_aux=True)(adapters)

    grads, reference = step(adapters, rest, IDS)
    want = jax.nn.log_softmax(_logits(base, IDS))
    np.testing.assert_allclose(np.asarray(reference), np.asarray(want), rtol=0, atol=1e-5)
    policy_grads = jax.jit(
        jax.grad(lambda a: jnp.sum(jax.nn.log_softmax(nnx.merge(graphdef, a, rest)(IDS))))
    )(adapters)
    # The reference adds nothing: the policy term's gradients, from another program (the
    # policy's log-softmax gradient 1 - V softmax cancels). Measured <= 1.3e-6 * scale.
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(policy_grads), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=4e-6 * np.abs(b).max())


# ----------------------------------------------------------------------- the switch


def test_restored_after_the_block_an_exception_and_nested_blocks():
    _, model = _base_and_adapted("lora", targets=["q_proj", "v_proj"])
    loras = _loras(model)
    state = lambda: [lora.adapter_enabled for lora in loras]
    assert len(loras) == 4 and state() == [True] * 4
    with pytest.raises(RuntimeError, match="inside"):
        with rl.adapters_disabled(model):
            assert state() == [False] * 4
            raise RuntimeError("inside")
    assert state() == [True] * 4
    with rl.adapters_disabled(model):
        with rl.adapters_disabled(model):
            assert state() == [False] * 4
        assert state() == [False] * 4  # the inner block restored what it found: off
    assert state() == [True] * 4
    loras[1].adapter_enabled = False  # switched off by hand: stays off
    with rl.adapters_disabled(model):
        assert state() == [False] * 4
    assert state() == [True, False, True, True]


def test_dropout_draws_nothing_with_the_adapters_off():
    _, model = _base_and_adapted("lora", targets=["q_proj"], dropout=0.5)
    model.train()
    count = lambda: [
        int(c.get_value()) for _, c in nnx.to_flat_state(nnx.state(model, nnx.RngCount))
    ]
    assert count() == [0, 0]
    with rl.adapters_disabled(model):
        model(IDS)
    assert count() == [0, 0]
    model(IDS)
    assert count() == [1, 1]


# ------------------------------------------------------------------------- refusals


def test_a_model_without_adapters_is_refused():
    model = LlamaForCausalLM(_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"holds no rudax.layers.LoRALinear.*reference copy"):
        with rl.adapters_disabled(model):
            pass
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got dict"):
        with rl.adapters_disabled({"q": model}):  # pyright: ignore[reportArgumentType]
            pass


# --------------------------------------------------------------------------------- FSDP

N = 8


@pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")
def test_fsdp_the_sharded_models_adapters_are_switched_off_too():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    base, model = _base_and_adapted("lora")
    policy = shard(model, rs.ShardingContext(mesh, "fsdp"))
    graphdef, state = nnx.split(policy)
    with rl.adapters_disabled(policy):  # each ShardedModule passes the switch on
        reference_graphdef = nnx.graphdef(policy)
    assert reference_graphdef != graphdef  # one state, two graph definitions
    switches = [getattr(m, "adapter_enabled", None) for _, m in nnx.iter_graph(policy)]
    assert switches.count(True) >= 2 and False not in switches  # restored on exit

    def both(state, ids):
        policy = nnx.merge(graphdef, state)(ids)
        return policy, nnx.merge(reference_graphdef, state)(ids)

    run = jax.jit(
        jax.shard_map(
            both, mesh=mesh, in_specs=(rs.shard_specs(state), P("fsdp")),
            out_specs=(P("fsdp"), P("fsdp")),
        )
    )  # fmt: skip
    ids = jnp.asarray(np.random.default_rng(1).integers(0, V, (N, 6)), jnp.int32)
    got_policy, got_reference = run(state, jax.device_put(ids, NamedSharding(mesh, P("fsdp"))))
    # Each rank's row through gathered weights: the one-device logits within fp32 rounding
    # (measured bit for bit).
    for got, want in ((got_policy, _logits(model, ids)), (got_reference, _logits(base, ids))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
