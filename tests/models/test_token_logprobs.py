"""causal_lm_token_logprobs against log-softmax over the full logits: rudax.post_train's
token_logprobs of the model's own logits (dense, LoRA, QLoRA, Mixtral, scanned layers; at
temperature 1 and 0.7, chunks that do and do not divide the tokens), transformers' logits of
the same weights, every completion of a shared-prefix row scored alone, the gradients through
the full logits, a bf16 model, generate's own log-probs of its samples, and an FSDP model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models import (
    IGNORE_INDEX,
    LlamaConfig,
    LlamaForCausalLM,
    _logprobs,
    causal_lm_token_logprobs,
    from_pretrained,
    generate,
    pack_shared_prefix,
    shard,
)
from rudax.post_train import token_logprobs
from tests.models._reference import hf_model

V = 64
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(**kw):
    base = dict(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaConfig(**{**base, **kw})


def _spread(model):
    """Weights 10x their init (N(0, 0.2)): logits of a few units, log-probs far from uniform."""
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var.get_value().ndim >= 2:
            var.set_value(10 * var.get_value())
    return model


def _randomize_lora(model, seed=7):
    """B non-zero (as after training), so the adapters change the model and A gets gradients."""
    state = nnx.state(model, rl.LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [
        0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, drawn))


def _model(kind, **kw):
    if kind == "mixtral":
        config = _config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
        return _spread(LlamaForCausalLM(config, rngs=nnx.Rngs(0), **kw))
    config = _config(tie_word_embeddings=kind == "dense")
    model = _spread(LlamaForCausalLM(config, rngs=nnx.Rngs(0), **kw))
    if kind in ("lora", "qlora"):
        quantize = "nf4" if kind == "qlora" else None
        rl.apply_lora(model, SEVEN, rank=4, alpha=8, quantize_base=quantize, rngs=nnx.Rngs(1))
        _randomize_lora(model)
    if kind == "scan":
        model.scan_layers = True
    return model


def _batch(seed=0, b=3, t=12, packed=True):
    """Random tokens, about 60% of them labelled; with ``packed``, two examples in row 0."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (b, t))
    labels = np.where(rng.random((b, t)) < 0.6, rng.integers(0, V, (b, t)), IGNORE_INDEX)
    batch = {"tokens": tokens, "labels": labels}
    if packed:
        segments = np.ones((b, t), int)
        segments[0, t // 2 :] = 2
        positions = np.tile(np.arange(t), (b, 1))
        positions[0, t // 2 :] -= t // 2
        batch |= {"segment_ids": segments, "positions": positions}
    return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def _full_logits_reference(model, batch, temperature):
    """token_logprobs of the model's own [B, T, V] logits: the plain, unchunked definition."""
    rest = {k: v for k, v in batch.items() if k not in ("tokens", "labels")}
    logits = model(batch["tokens"], **rest)
    return token_logprobs(logits, batch["labels"], temperature=temperature)


# ------------------------------------------------------------ the full-logits definition


@pytest.mark.parametrize("kind", ["dense", "lora", "qlora", "mixtral", "scan"])
def test_equals_token_logprobs_of_the_full_logits(kind):
    model = _model(kind)
    batch = _batch()
    counted = np.asarray(batch["labels"]) != IGNORE_INDEX
    for temperature in (1.0, 0.7):
        want = np.asarray(_full_logits_reference(model, batch, temperature))
        # 36 tokens: chunks of 5 (a remainder of 1, crossing rows), 12 (one per row), and
        # one chunk of everything.
        for chunk in (5, 12, 1024):
            got = causal_lm_token_logprobs(model, batch, temperature=temperature, chunk=chunk)
            assert got.shape == (3, 12) and got.dtype == jnp.float32
            got = np.asarray(got)
            assert (got[~counted] == 0).all()
            # The sampler's shift-then-divide against TRL's divide-then-logsumexp: fp32
            # rounding of log-probs down to -11 (an ulp there is 9.5e-7). Measured <= 1.9e-6.
            np.testing.assert_allclose(
                got, want, rtol=0, atol=4e-6, err_msg=f"{temperature=} {chunk=}"
            )
            assert (got[counted] < 0).all()


def test_equals_transformers_log_softmax_at_the_labels(tmp_path):
    hf = hf_model(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    batch = _batch(seed=1, b=2, t=16, packed=False)
    tokens = torch.tensor(np.asarray(batch["tokens"]), dtype=torch.long)
    labels = np.asarray(batch["labels"])
    with torch.no_grad():
        logits = hf(tokens).logits.double()
    for temperature in (1.0, 0.7):
        logp = torch.log_softmax(logits / temperature, dim=-1).numpy()
        want = np.where(
            labels != IGNORE_INDEX,
            np.take_along_axis(logp, np.maximum(labels, 0)[..., None], axis=-1)[..., 0],
            0.0,
        )
        got = np.asarray(causal_lm_token_logprobs(model, batch, temperature=temperature, chunk=7))
        # Two fp32 programs of two layers against float64 of transformers' fp32 logits.
        # Measured <= 2.5e-6.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{temperature=}")


# ------------------------------------------------------------------ shared-prefix rows

EXAMPLES = [
    ([3, 14, 15, 9, 26, 5, 35, 8, 9], [[7, 9, 3, 2], [38, 4, 6, 2, 6, 4], [33]]),
]


def test_shared_prefix_rows_score_each_completion_as_if_alone():
    model = _model("lora")
    shared = pack_shared_prefix(EXAMPLES)
    (prompt, completions) = EXAMPLES[0]
    # Unshared: one row per completion, ``prompt + completion`` alone, padding after it.
    length = len(prompt) + max(map(len, completions))
    alone = {k: np.zeros((len(completions), length), np.int32) for k in ("tokens", "segment_ids")}
    alone["labels"] = np.full((len(completions), length), IGNORE_INDEX, np.int32)
    alone["positions"] = np.tile(np.arange(length, dtype=np.int32), (len(completions), 1))
    for i, c in enumerate(completions):
        seq = prompt + c
        alone["tokens"][i, : len(seq)] = seq
        alone["segment_ids"][i, : len(seq)] = 1
        alone["labels"][i, len(prompt) - 1 : len(seq) - 1] = c
    for temperature in (1.0, 0.7):
        got = causal_lm_token_logprobs(model, shared.batch(), temperature=temperature, chunk=4)
        want = causal_lm_token_logprobs(model, alone, temperature=temperature, chunk=4)
        got = np.asarray(got)[shared.labels != IGNORE_INDEX]
        want = np.asarray(want)[alone["labels"] != IGNORE_INDEX]
        assert got.shape == want.shape == (sum(map(len, completions)),)
        # Per token, completion by completion in order: the same attention over another
        # layout, log-probs down to -10. Measured <= 3.4e-6.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{temperature=}")
        # ... and grouped by completion as rudax.post_train sums them.
        per_completion = [np.asarray(want)[a:b].sum() for a, b in ((0, 4), (4, 10), (10, 11))]
        assert np.all(np.isfinite(per_completion))


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(("kind", "trained"), [("lora", rl.LoRAParam), ("dense", nnx.Param)])
def test_gradients_equal_those_through_the_full_logits(kind, trained):
    # LoRA: the adapters' gradients; dense (tied head): every parameter's, the head's table
    # (summed over the chunks) and the embedding's lookup in one leaf.
    model = _model(kind)
    batch = _batch(seed=2)
    weights = jax.random.normal(jax.random.key(3), batch["labels"].shape)
    graphdef, params, rest = nnx.split(model, trained, ...)
    temperature = 0.7

    @jax.jit
    def grads(params, rest, batch):
        def ours(p):
            m = nnx.merge(graphdef, p, rest)
            return jnp.sum(
                causal_lm_token_logprobs(m, batch, temperature=temperature, chunk=5) * weights
            )

        def reference(p):
            m = nnx.merge(graphdef, p, rest)
            return jnp.sum(_full_logits_reference(m, batch, temperature) * weights)

        return jax.grad(ours)(params), jax.grad(reference)(params)

    got, want = grads(params, rest, batch)
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want) > 0
    for (path, a), b in zip(flat_got, flat_want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.abs(b).max()
        assert scale > 0, jax.tree_util.keystr(path)
        # Another summation order (chunks) of the same fp32 terms. Measured <= 8e-7 * scale.
        np.testing.assert_allclose(
            a, b, rtol=0, atol=2e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )


# --------------------------------------------------------------------------------- bf16


def test_a_bf16_model_is_finite_and_close_to_fp32():
    batch = _batch(seed=4)
    counted = np.asarray(batch["labels"]) != IGNORE_INDEX
    fp32 = np.asarray(causal_lm_token_logprobs(_model("lora"), batch, chunk=5))
    model = _model("lora", dtype=jnp.bfloat16)
    got = causal_lm_token_logprobs(model, batch, chunk=5)
    assert got.dtype == jnp.float32
    got = np.asarray(got)
    assert np.isfinite(got).all() and (got[~counted] == 0).all()
    # bf16 matmuls (8 significant bits) through two layers, log-probs down to -7: measured
    # 0.14 (2% of the largest).
    np.testing.assert_allclose(got, fp32, rtol=0, atol=0.3)
    # ... and exactly the bf16 model's own logits (rounded to bf16, then fp32), TRL's way:
    # the head's rounding is the model's. Measured 2.4e-7.
    want = np.asarray(_full_logits_reference(model, batch, 1.0))
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)


# ------------------------------------------------------------------ the sampler's numbers


def test_equals_generate_logprobs_of_its_samples():
    """What a trainer recomputes is what the sampler reported, at its temperature."""
    model = _model("lora")
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1]]
    for temperature in (0.7, 0.0):
        out = generate(
            model, prompts, 6, temperature=temperature, num_samples=2, rng=jax.random.key(5),
            return_logprobs=True, stop_tokens=[V - 1],
        )  # fmt: skip
        rows = [prompts[i // 2] + out.tokens[i] for i in range(4)]
        length = max(map(len, rows))
        tokens = np.zeros((4, length), np.int32)
        labels = np.full((4, length), IGNORE_INDEX, np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
            labels[i, 3 : len(row) - 1] = row[4:]  # each new token, predicted at the one before
        batch = {"tokens": tokens, "labels": labels}
        got = causal_lm_token_logprobs(model, batch, temperature=temperature or 1.0, chunk=8)
        got = np.asarray(got)[labels != IGNORE_INDEX]
        want = np.concatenate(out.logprobs)
        # The cache's decode path against one forward over the whole row: fp32 rounding.
        # Measured <= 3.1e-6.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{temperature=}")


# --------------------------------------------------------------------------------- FSDP

N = 8


@pytest.mark.skipif(jax.device_count() < N, reason=f"needs {N} devices")
def test_the_sharded_model_gives_the_one_device_logprobs_and_gradients():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    model = _model("lora")
    sharded = shard(model, rs.ShardingContext(mesh, "fsdp"))
    batch = _batch(seed=5, b=N, t=8, packed=False)
    weights = jax.random.normal(jax.random.key(6), batch["labels"].shape)

    graph, adapters, rest = nnx.split(sharded, rl.LoRAParam, ...)

    def local(a, r, b, w):
        logp = causal_lm_token_logprobs(nnx.merge(graph, a, r), b, temperature=0.7, chunk=3)
        return jax.lax.psum(jnp.sum(logp * w), "fsdp"), logp

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(rs.shard_specs(adapters), rs.shard_specs(rest), P("fsdp"),
        P("fsdp")), out_specs=(P(), P("fsdp")),
    )  # fmt: skip
    placed = jax.device_put((batch, weights), NamedSharding(mesh, P("fsdp")))
    (_, logp), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(adapters, rest, *placed)

    ref_graph, ref_adapters, ref_rest = nnx.split(model, rl.LoRAParam, ...)

    def ref_total(a):
        logp = causal_lm_token_logprobs(
            nnx.merge(ref_graph, a, ref_rest), batch, temperature=0.7, chunk=3
        )
        return jnp.sum(logp * weights), logp

    (_, ref_logp), ref_grads = jax.jit(jax.value_and_grad(ref_total, has_aux=True))(ref_adapters)
    # Each rank's rows through gathered weights, in another program: measured <= 3.4e-6.
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=0, atol=1e-5)
    nnx.update(sharded, grads)
    got = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                if isinstance(var, rl.LoRAParam):
                    got[(*prefix, *path)] = var.get_value().unshard()
    want = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(ref_grads)}
    assert set(want) == set(got) and len(want) == 2 * 2 * len(SEVEN)
    # tests/models/test_shard.py's bounds: the sharded sums run in another order, and an
    # element near cancellation is off by more than its share (measured 9.5e-6 on 0.006).
    for path, value in want.items():
        atol = 2e-6 * np.abs(value).max()
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=atol, err_msg=str(path))


# --------------------------------------------------------------------------------- memory


def test_the_whole_logits_are_never_held():
    """XLA's own accounting of the gradient program: its scratch memory holds a few chunks'
    logits, not the [N, V] fp32 logits that the full-logits gradient holds twice."""
    n, v, d, chunk = 4096, 4000, 32, 256
    h = jax.random.normal(jax.random.key(0), (n, d))
    table = jax.random.normal(jax.random.key(1), (v, d))
    labels = jax.random.randint(jax.random.key(2), (n,), 0, v)
    t = jnp.float32(0.7)

    def chunked(h, table):
        logp = _logprobs._chunked_logprobs(
            h, table, labels, t, chunk=chunk, dtype=np.dtype(np.float32)
        )
        return jnp.sum(logp)

    def full(h, table):
        return jnp.sum(token_logprobs(h @ table.T, labels, temperature=0.7))

    def scratch(f):
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, table).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = n * v * 4
    # Measured on XLA:CPU: 0.126 of the logits' 62.5 MB (two [chunk, V] arrays, 1/16 each),
    # and 2.0 through the full logits.
    assert scratch(chunked) < 0.25 * logits_bytes < logits_bytes <= scratch(full)


# ----------------------------------------------------------------------- compile once


def test_a_second_call_with_new_values_does_not_recompile():
    model = _model("lora")
    graphdef, state = nnx.split(model)
    _logprobs._chunked_logprobs.clear_cache()

    @jax.jit
    def run(state, batch):
        return causal_lm_token_logprobs(nnx.merge(graphdef, state), batch, temperature=0.7)

    first = run(state, _batch(seed=6))
    second = run(jax.tree.map(lambda x: x * 1.01, state), _batch(seed=7))
    assert run._cache_size() == 1
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    # Called eagerly, a new temperature is a new value of the same program, as in generate.
    for temperature in (0.7, 1.0, 1.3):
        causal_lm_token_logprobs(model, _batch(seed=8), temperature=temperature, chunk=5)
    assert _logprobs._chunked_logprobs._cache_size() == 1


# ------------------------------------------------------------------------ bad arguments


POSITIVE = r"temperature must be a finite number > 0, got temperature="


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, POSITIVE + "0.0"),
        ({"temperature": -0.5}, ValueError, POSITIVE + "-0.5"),
        ({"temperature": float("nan")}, ValueError, POSITIVE + "nan"),
        ({"temperature": float("inf")}, ValueError, POSITIVE + "inf"),
        ({"temperature": 1e-40}, ValueError, r"temperature must be in float32's normal range"),
        ({"temperature": True}, TypeError, r"temperature must be a real number, got .*True"),
        ({"temperature": jnp.float32(0.7)}, TypeError, r"temperature must be a real number"),
        ({"chunk": 0}, ValueError, r"chunk must be a positive int, got 0"),
        ({"chunk": 2.0}, ValueError, r"chunk must be a positive int, got 2.0"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        causal_lm_token_logprobs(_model("dense"), _batch(), **kwargs)


def test_bad_batches_and_models_are_named():
    model = _model("dense")
    batch = _batch()
    with pytest.raises(TypeError, match=r"batch\['labels'\] must hold integers, got .*float32"):
        causal_lm_token_logprobs(model, {**batch, "labels": batch["labels"].astype(jnp.float32)})
    with pytest.raises(ValueError, match=r"missing \['labels'\]"):
        causal_lm_token_logprobs(model, {"tokens": batch["tokens"]})
    with pytest.raises(ValueError, match=r"one shape \[batch, time\]"):
        causal_lm_token_logprobs(model, {**batch, "labels": batch["labels"][:, :5]})
    with pytest.raises(TypeError, match=r"model must be a rudax.models.LlamaForCausalLM"):
        causal_lm_token_logprobs(nnx.Dict(), batch)
