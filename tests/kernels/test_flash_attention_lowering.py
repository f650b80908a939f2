"""flash_attention's Pallas kernels lowered for CUDA from this CPU host, at the shapes users run.

Interpret mode (tests/kernels/test_flash_attention.py) checks the kernels' arithmetic; only
the Triton lowering checks what a GPU compile needs (power-of-two tiles, supported primitives
in the kernel bodies, the dynamic loop bounds and ``cond``s of the masks). Exporting for
``platforms=["cuda"]`` runs that lowering here: the forward must contain
``flash_attention_fwd`` and the backward its two kernels, ``flash_attention_dkdv`` and
``flash_attention_dq``, and no kernel body may use an atomic operation (the backward's
ordered, reproducible design).
"""

import jax
import jax.numpy as jnp
import pytest

import rudax.kernels as rk
from tests.kernels._lowering import assert_lowers_for_gpu

BF16 = jnp.bfloat16

# (B, T, H, G, head_dim, options): Llama-style shapes with head_dim 64 and 128; GQA 4 and 8;
# a length that is not a multiple of the blocks; every mask feature.
CASES = [
    pytest.param(2, 4096, 32, 32, 128, dict(causal=True), id="mha-128-causal-4k"),
    pytest.param(1, 8192, 32, 8, 128, dict(causal=True), id="gqa4-128-causal-8k"),
    pytest.param(2, 2048, 16, 2, 64, dict(causal=True), id="gqa8-64-causal"),
    pytest.param(1, 1000, 12, 4, 64, dict(causal=True, window=(255, 0)), id="gqa3-window"),
    pytest.param(1, 512, 8, 8, 64, dict(softcap=50.0), id="softcap-bidirectional"),
    pytest.param(1, 96, 6, 2, 80, dict(causal=True), id="head-dim-80-padded"),
]


@pytest.mark.parametrize("b, t, h, g, k, options", CASES)
def test_lowers_for_cuda(b, t, h, g, k, options):
    q = jax.ShapeDtypeStruct((b, t, h, k), BF16)
    kv = jax.ShapeDtypeStruct((b, t, g, k), BF16)
    assert_lowers_for_gpu(
        lambda q, k, v: rk.flash_attention(q, k, v, impl="pallas", **options),
        q,
        kv,
        kv,
        kernels=["flash_attention_fwd"],
        backward_kernels=["flash_attention_dkdv", "flash_attention_dq"],
    )


def test_packed_rows_lower_for_cuda():
    b, t, h, g, k = 2, 4096, 32, 8, 128
    assert_lowers_for_gpu(
        lambda q, k, v, seg: rk.flash_attention(
            q, k, v, causal=True, segment_ids=seg, impl="pallas"
        ),
        jax.ShapeDtypeStruct((b, t, h, k), BF16),
        jax.ShapeDtypeStruct((b, t, g, k), BF16),
        jax.ShapeDtypeStruct((b, t, g, k), BF16),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        kernels=["flash_attention_fwd"],
        backward_kernels=["flash_attention_dkdv", "flash_attention_dq"],
    )


def test_no_kernel_uses_atomics():
    q = jnp.zeros((1, 64, 4, 32), BF16)
    kv = jnp.zeros((1, 64, 2, 32), BF16)
    seg = jnp.zeros((1, 64), jnp.int32)

    def fwd_bwd(q, k, v):
        f = lambda q, k, v: rk.flash_attention(
            q, k, v, causal=True, segment_ids=seg, impl="pallas", interpret=True
        )
        out, vjp = jax.vjp(f, q, k, v)
        return vjp(out)

    text = str(jax.make_jaxpr(fwd_bwd)(q, kv, kv))
    for name in ("flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq"):
        assert name in text
    assert "atomic" not in text


@pytest.mark.parametrize("window", [None, (4095, 0)], ids=["causal", "window"])
def test_shared_prefix_rows_lower_for_cuda(window):
    """branch_ids (and, with a window, the unshared positions) reach every kernel as blocks
    of int32 ids; SmolLM's 9/3 heads of 64 on a row of 1024 + 8 x 128 tokens."""
    b, t, h, g, k = 1, 1024 + 8 * 128, 9, 3, 64
    assert_lowers_for_gpu(
        lambda q, k, v, seg, br: rk.flash_attention(
            q, k, v, causal=True, segment_ids=seg, branch_ids=br, window=window, impl="pallas"
        ),
        jax.ShapeDtypeStruct((b, t, h, k), BF16),
        jax.ShapeDtypeStruct((b, t, g, k), BF16),
        jax.ShapeDtypeStruct((b, t, g, k), BF16),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        kernels=["flash_attention_fwd"],
        backward_kernels=["flash_attention_dkdv", "flash_attention_dq"],
    )
