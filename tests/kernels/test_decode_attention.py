"""rudax.kernels.decode_attention against its plain reference and flash_attention's, and the
compiled program: the cache is read where it lies, never copied or transposed."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk

# jitted, so each case compiles one program instead of one per jnp operation
decode = jax.jit(rk.decode_attention, static_argnames="scale")
reference = jax.jit(rk.decode_attention_reference, static_argnames="scale")


def _case(key, *, rows, groups, heads, kv_heads, own, shared, dtype=jnp.float32, k=16):
    """Random operands: ``groups`` shared blocks of ``shared`` slots for ``rows`` rows."""
    ks = jax.random.split(key, 7)
    normal = lambda i, shape: jax.random.normal(ks[i], shape, jnp.float32).astype(dtype)
    q = normal(0, (rows, heads, k))
    own_k, own_v = normal(1, (rows, kv_heads, own, k)), normal(2, (rows, kv_heads, own, k))
    sh_k = normal(3, (groups, kv_heads, shared, k))
    sh_v = normal(4, (groups, kv_heads, shared, k))
    seen = jax.random.bernoulli(ks[5], 0.7, (rows, own))
    sh_seen = jax.random.bernoulli(ks[6], 0.7, (rows, shared))
    # edge rows: one sees nothing at all, one only its shared block, one only its own slots
    seen = seen.at[0].set(False).at[1].set(False).at[2].set(True)
    sh_seen = sh_seen.at[0].set(False).at[1].set(True).at[2].set(False)
    return q, own_k, own_v, seen, sh_k, sh_v, sh_seen


@pytest.mark.parametrize(
    ("heads", "kv_heads", "groups"),
    [(6, 3, 2), (4, 1, 1), (4, 4, 4), (6, 2, 3)],
    ids=["gqa-2-prompts", "mqa-1-prompt", "mha-no-sharing", "gqa-3-prompts"],
)
def test_equals_the_reference(heads, kv_heads, groups):
    q, k, v, seen, sk, sv, sseen = _case(
        jax.random.key(0), rows=12, groups=groups, heads=heads, kv_heads=kv_heads, own=5, shared=9
    )
    got = decode(q, k, v, seen, shared_k=sk, shared_v=sv, shared_visible=sseen)
    want = reference(q, k, v, seen, shared_k=sk, shared_v=sv, shared_visible=sseen)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(got[0]))  # the row that sees nothing: zeros
    # without a shared block: the own slots alone
    alone = decode(q, k, v, seen, scale=0.3)
    want_alone = reference(q, k, v, seen, scale=0.3)
    np.testing.assert_allclose(np.asarray(alone), np.asarray(want_alone), rtol=1e-6, atol=1e-6)


def test_bf16_rounds_as_the_reference():
    q, k, v, seen, sk, sv, sseen = _case(
        jax.random.key(1), rows=8, groups=2, heads=6, kv_heads=3, own=7, shared=20,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    got = decode(q, k, v, seen, shared_k=sk, shared_v=sv, shared_visible=sseen)
    want = reference(q, k, v, seen, shared_k=sk, shared_v=sv, shared_visible=sseen)
    assert got.dtype == jnp.bfloat16
    # bf16 products of the same bf16 probabilities, fp32 sums in another order: 1 bf16 ulp
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert diff.max() <= 2.0**-7 * max(1.0, float(np.abs(np.asarray(want, np.float32)).max()))


def test_each_row_is_flash_attention_over_its_pages():
    """Row b's one query over [its prompt's slots, its own] in flash_attention's [B, S, G, K]
    layout, the invisible slots given segment 0: flash_attention_reference's function."""
    rows, groups = 6, 2
    q, k, v, seen, sk, sv, sseen = _case(
        jax.random.key(2), rows=rows, groups=groups, heads=6, kv_heads=3, own=4, shared=11
    )
    got = decode(q, k, v, seen, shared_k=sk, shared_v=sv, shared_visible=sseen)
    n = rows // groups
    pages_k = jnp.concatenate([jnp.repeat(sk, n, axis=0), k], axis=2).transpose(0, 2, 1, 3)
    pages_v = jnp.concatenate([jnp.repeat(sv, n, axis=0), v], axis=2).transpose(0, 2, 1, 3)
    visible = jnp.concatenate([sseen, seen], axis=1)
    want = jax.jit(rk.flash_attention_reference)(
        q[:, None],
        pages_k,
        pages_v,
        segment_ids=jnp.ones((rows, 1), jnp.int32),
        kv_segment_ids=visible.astype(jnp.int32),
    )[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_the_compiled_step_never_copies_the_cache():
    """SmolLM-135M's decode shapes (3 kv heads of 64, 9 query heads), 8 samples of a 512-token
    prompt: no instruction of the compiled program makes an array as large as a cache block
    (a transpose or copy of it would); XLA's dots read both blocks where they lie."""
    rows, g, k, p, own = 8, 3, 64, 512, 32
    f32 = jnp.float32
    q = jax.ShapeDtypeStruct((rows, 9, k), f32)
    own_k = jax.ShapeDtypeStruct((rows, g, own, k), f32)
    sh_k = jax.ShapeDtypeStruct((1, g, p, k), f32)
    seen = jax.ShapeDtypeStruct((rows, own), jnp.bool_)
    sh_seen = jax.ShapeDtypeStruct((rows, p), jnp.bool_)

    def step(q, own_k, own_v, seen, sh_k, sh_v, sh_seen):
        return rk.decode_attention(
            q, own_k, own_v, seen, shared_k=sh_k, shared_v=sh_v, shared_visible=sh_seen
        )

    hlo = jax.jit(step).lower(q, own_k, own_k, seen, sh_k, sh_k, sh_seen).compile().as_text()
    smallest_block = min(rows * g * own * k, g * p * k)
    big = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* (\w+)\(", line)
        if m and m.group(3) not in ("parameter", "bitcast", "get-tuple-element", "tuple"):
            size = math.prod(int(d) for d in m.group(2).split(",") if d)
            if size >= smallest_block:
                big.append(line.strip()[:160])
    assert not big, "the compiled decode step makes cache-sized arrays:\n" + "\n".join(big)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k": jnp.zeros((4, 2, 5, 8))}, ValueError, r"k and v must have the same shape"),
        ({"q": jnp.zeros((4, 5, 8))}, ValueError, r"kv_heads must divide q's heads"),
        ({"visible": jnp.ones((4, 5), jnp.int32)}, ValueError, r"visible must be bool"),
        ({"v": jnp.zeros((4, 3, 5, 8), jnp.bfloat16)}, TypeError, r"v\.dtype=bfloat16"),
        ({"shared_v": None}, ValueError, r"go together; missing \['shared_v'\]"),
        (
            {"shared_k": jnp.zeros((3, 3, 6, 8)), "shared_v": jnp.zeros((3, 3, 6, 8))},
            ValueError,
            r"shared_k's groups must divide the batch .* 3 groups for batch 4",
        ),
        ({"shared_visible": jnp.ones((2, 6), bool)}, ValueError, r"shared_visible must be bool"),
        ({"scale": -1.0}, ValueError, r"scale must be None or a finite float > 0, got scale=-1"),
    ],
)
def test_bad_operands_are_named(change, error, match):
    args = {
        "q": jnp.zeros((4, 6, 8)),
        "k": jnp.zeros((4, 3, 5, 8)),
        "v": jnp.zeros((4, 3, 5, 8)),
        "visible": jnp.ones((4, 5), bool),
        "shared_k": jnp.zeros((2, 3, 6, 8)),
        "shared_v": jnp.zeros((2, 3, 6, 8)),
        "shared_visible": jnp.ones((4, 6), bool),
        "scale": None,
    }
    args.update(change)
    q, k, v, visible = (args.pop(n) for n in ("q", "k", "v", "visible"))
    with pytest.raises(error, match=match):
        rk.decode_attention(q, k, v, visible, **args)
