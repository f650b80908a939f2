"""flash_attention's ``branch_ids``: a shared prefix against its unshared layout.

A shared row ``[prompt, completion 1, ..., completion G]`` (branch ids 0, 1, ..., G) must
compute what the unshared layout computes: each completion after its own copy of the prompt,
``[prompt, completion g]`` as segment g of one row, through ``segment_ids`` (no branches).
The prompt's outputs equal each copy's; every completion token's output, dQ, dK and dV equal
its copy's; the prompt's dK and dV (and dQ) equal the sum over its copies.

The cotangent of the unshared layout is zero on every copy of the prompt but the first, so
the shared layout's cotangent is the same numbers (no sum rounded to a low precision): the
two losses ``sum(out * d_out)`` are then one function of the shared inputs.

Tolerances are the bounds of ``tests/kernels/test_flash_attention.py``: the float64
reference of the unshared layout, with each result's magnitude, gives a bound on each
unshared result; mapped to the shared layout (a prompt's gradient: the sum of its copies'
bounds, whose operation counts cover the shared sum's), it bounds the shared kernel's error.
The two kernels then differ by at most twice the bound.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk
from tests.kernels.test_flash_attention import (
    DTYPE_IDS,
    IMPLS,
    SMALL,
    U32,
    _check,
    _eps,
    _reference,
)

GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of packed examples, each ``(prompt length, [completion lengths])``."""

    name: str
    examples: tuple[tuple[int, tuple[int, ...]], ...]
    h: int = 2
    g: int = 2
    kdim: int = 16
    window: tuple[int, int] | None = None
    softcap: float | None = None
    block: rk.FlashAttentionBlock = SMALL

    @property
    def segmented(self) -> bool:
        return len(self.examples) > 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shared row's ids and the unshared row's tokens as indices into the shared row."""

    segment: np.ndarray  # [T] shared: example ids 1, 2, ...
    branch: np.ndarray  # [T] shared: 0 the prompt, g its completion g
    gather: np.ndarray  # [Tu] the shared token each unshared token copies
    unshared_segment: np.ndarray  # [Tu] one segment per (example, completion)
    first_copy: np.ndarray  # [Tu] whether the token is the first copy of its shared token


def _layout(examples) -> Layout:
    segment, branch, gather, useg, first = [], [], [], [], []
    for example, (p, completions) in enumerate(examples, start=1):
        prompt = list(range(len(segment), len(segment) + p))
        segment += [example] * p
        branch += [0] * p
        for g, r in enumerate(completions or (0,), start=1):
            start = len(segment)
            segment += [example] * r
            branch += [g] * r
            gather += prompt + list(range(start, start + r))
            useg += [len(set(useg)) + 1] * (p + r)
            first += [g == 1] * p + [True] * r
    as_np = lambda x, dt=np.int32: np.asarray(x, dt)
    return Layout(as_np(segment), as_np(branch), as_np(gather), as_np(useg), as_np(first, bool))


CASES = {
    c.name: c
    for c in [
        Case("basic", ((20, (9, 5, 12)),)),  # T = 46: not a multiple of a block
        Case("gqa3", ((13, (7, 7, 3)),), h=6, g=2),
        Case("gqa8", ((9, (4, 11, 6)),), h=8, g=1),
        # The third completion starts 35 tokens after the prompt's end in the row, 0 in its
        # own layout: a window of 7 must be measured there.
        Case("window", ((20, (10, 6, 9)),), window=(7, 0)),
        Case("softcap", ((17, (8, 8)),), h=4, g=2, softcap=3.0),
        Case("one-token-branches", ((6, (1, 1, 1, 1, 1)),)),
        Case("one-branch", ((10, (14,)),)),
        Case("sixteen-branches", ((5, (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4)),)),
        Case("one-token-prompt", ((1, (8, 5, 9)),)),
        # Two examples and a plain one (no completions) in one row, with segment ids.
        Case("packed", ((7, (5, 3)), (4, (6, 2, 2)), (5, ())), h=4, g=1, window=(6, 0)),
    ]
}
# Every case in fp32; in bf16 and fp16 the cases whose rounding differs most (segments and a
# window; softcap), the others under -m slow (their branches are the fp32 case's).
CASE_DTYPES = [
    pytest.param(case, dtype, id=f"{case.name}-{DTYPE_IDS[dtype]}", marks=[pytest.mark.slow] * slow)
    for case, dtype, slow in [(c, jnp.float32, False) for c in CASES.values()]
    + [(CASES[n], jnp.bfloat16, n != "packed") for n in ("basic", "window", "packed")]
    + [(CASES[n], jnp.float16, n != "softcap") for n in ("gqa3", "softcap")]
]


def _draw(rng, dtype, *shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


@functools.partial(jax.jit, static_argnums=(6, 7))
def _shared(q, k, v, d_out, segment_ids, branch_ids, case, impl):
    impl_kwargs = dict(impl)
    f = lambda q, k, v: rk.flash_attention(
        q, k, v, causal=True, segment_ids=segment_ids, branch_ids=branch_ids,
        window=case.window, softcap=case.softcap, block=case.block, **impl_kwargs,
    )  # fmt: skip
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


@functools.partial(jax.jit, static_argnums=(5, 6))
def _unshared(q, k, v, d_out, segment_ids, case, impl):
    impl_kwargs = dict(impl)
    f = lambda q, k, v: rk.flash_attention(
        q, k, v, causal=True, segment_ids=segment_ids, window=case.window,
        softcap=case.softcap, block=case.block, **impl_kwargs,
    )  # fmt: skip
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


def _operands(case, layout, dtype, seed=0):
    rng = np.random.default_rng(seed)
    t, tu = len(layout.branch), len(layout.gather)
    q = _draw(rng, dtype, 1, t, case.h, case.kdim)
    k = _draw(rng, dtype, 1, t, case.g, case.kdim)
    v = _draw(rng, dtype, 1, t, case.g, case.kdim)
    d_out_u = np.array(_draw(rng, dtype, 1, tu, case.h, case.kdim).astype(jnp.float32))
    d_out_u[:, ~layout.first_copy] = 0  # see the module docstring
    d_out = np.zeros((1, t, case.h, case.kdim), np.float32)
    d_out[:, layout.gather[layout.first_copy]] = d_out_u[:, layout.first_copy]
    return q, k, v, jnp.asarray(d_out, dtype), jnp.asarray(d_out_u, dtype)


def _to_shared(x_u, layout, t, *, first_only=False):
    """[1, Tu, ...] unshared -> [1, T, ...]: the first copy's value, or the sum of copies'."""
    x_u = np.asarray(x_u).astype(np.float64)
    out = np.zeros((1, t, *x_u.shape[2:]))
    if first_only:
        out[:, layout.gather[layout.first_copy]] = x_u[:, layout.first_copy]
    else:
        np.add.at(out, (slice(None), layout.gather), x_u)
    return out


def _ids(case, layout):
    segment = jnp.asarray(layout.segment[None]) if case.segmented else None
    return segment, jnp.asarray(layout.branch[None])


def _run_shared(case, layout, impl, q, k, v, d_out):
    segment, branch = _ids(case, layout)
    return _shared(q, k, v, d_out, segment, branch, case, tuple(sorted(impl.items())))


@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_shared_prefix_equals_unshared_layout(impl, case, dtype):
    layout = _layout(case.examples)
    t = len(layout.branch)
    q, k, v, d_out, d_out_u = _operands(case, layout, dtype)
    shared = _run_shared(case, layout, impl, q, k, v, d_out)
    for x, like in zip(shared, (q, q, k, v), strict=True):
        assert x.dtype == dtype and x.shape == like.shape

    gather = jnp.asarray(layout.gather)
    qu, ku, vu = q[:, gather], k[:, gather], v[:, gather]
    useg = jnp.asarray(layout.unshared_segment[None])
    unshared = _unshared(qu, ku, vu, d_out_u, useg, case, tuple(sorted(impl.items())))

    # The float64 reference of the unshared layout, its bounds, mapped to the shared layout.
    values, magnitudes, caps, zmax = _reference(
        qu, ku, vu, d_out_u, causal=True, segment_ids=np.asarray(useg), window=case.window,
        softcap=case.softcap,
    )  # fmt: skip
    tu = len(layout.gather)
    eps_out, eps_grad = _eps(dtype, kdim=case.kdim, t=tu, s=tu, r=case.h // case.g, zmax=zmax)
    for i, name in enumerate(("out", *GRADS)):
        eps = eps_out if name == "out" else eps_grad
        bound_u = eps * magnitudes[name] + 4 * U32 * caps[name]
        first = name == "out"
        want = _to_shared(values[name], layout, t, first_only=first)
        bound = _to_shared(bound_u, layout, t, first_only=first)
        _check(shared[i], want, bound, f"shared {name} vs float64")
        if first:  # every copy of a prompt token has the shared token's output
            got = np.asarray(shared[0]).astype(np.float64)[:, layout.gather]
            _check(got, np.asarray(unshared[0], np.float64), 2 * bound_u, "out vs each copy")
        else:
            got_u = _to_shared(unshared[i], layout, t)
            _check(shared[i], got_u, 2 * bound, f"shared {name} vs unshared kernel")


@pytest.mark.parametrize("impl", IMPLS)
def test_same_bits_twice_and_other_branches_change_nothing(impl):
    """Run to run, the same bits; a branch's results do not depend on another branch's tokens
    (masked keys add exact zeros), bit for bit."""
    case = CASES["basic"]
    layout = _layout(case.examples)
    q, k, v, d_out, _ = _operands(case, layout, jnp.float32)
    first = _run_shared(case, layout, impl, q, k, v, d_out)
    again = _run_shared(case, layout, impl, q, k, v, d_out)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)

    two = jnp.asarray(layout.branch == 2)[None, :, None, None]
    noise = lambda x, seed: jnp.where(two, jax.random.normal(jax.random.key(seed), x.shape), x)
    changed = _run_shared(
        case, layout, impl, noise(q, 1), noise(k, 2), noise(v, 3), noise(d_out, 4)
    )
    one = layout.branch == 1
    for a, b, name in zip(first, changed, ("out", *GRADS), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a)[:, one], np.asarray(b)[:, one], err_msg=name, strict=True
        )
    assert not np.array_equal(np.asarray(first[2])[:, layout.branch == 0],
                              np.asarray(changed[2])[:, layout.branch == 0])  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_key_blocks_of_other_branches_are_skipped(impl):
    """Branches aligned to the blocks (16 tokens, Pallas; 8, XLA): NaN keys and values in
    branch 2 reach no other branch, so its blocks are never computed for them (a computed
    block's masked product would still multiply 0 by NaN)."""
    case = Case("aligned", ((16, (16, 16, 16, 16, 16)),))
    layout = _layout(case.examples)
    q, k, v, d_out, _ = _operands(case, layout, jnp.float32)
    two = jnp.asarray(layout.branch == 2)[None, :, None, None]
    k, v = (jnp.where(two, jnp.nan, x) for x in (k, v))
    out, dq, dk, dv = _run_shared(case, layout, impl, q, k, v, d_out)
    # The prompt's dK and dV sum over branch 2's queries too: NaN, rightly.
    for x, name, clean in (
        (out, "out", layout.branch != 2),
        (dq, "dq", layout.branch != 2),
        (dk, "dk", np.isin(layout.branch, (1, 3, 4, 5))),
        (dv, "dv", np.isin(layout.branch, (1, 3, 4, 5))),
    ):
        assert np.isfinite(np.asarray(x)[:, clean]).all(), name
    assert np.isnan(np.asarray(out)[:, layout.branch == 2]).all()


def test_reference_takes_branches():
    case = CASES["packed"]
    layout = _layout(case.examples)
    q, k, v, *_ = _operands(case, layout, jnp.float32)
    segment, branch = _ids(case, layout)
    got = rk.flash_attention_reference(
        q, k, v, causal=True, segment_ids=segment, branch_ids=branch, window=case.window
    )
    gather = jnp.asarray(layout.gather)
    want = rk.flash_attention_reference(
        q[:, gather], k[:, gather], v[:, gather], causal=True, window=case.window,
        segment_ids=jnp.asarray(layout.unshared_segment[None]),
    )  # fmt: skip
    got_u = np.asarray(got)[:, layout.gather]
    np.testing.assert_allclose(got_u, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_work_skips_other_branches():
    """The XLA path's executed blocks, counted through a cost-free probe: the forward's
    key-block loop runs ``update`` only where ``Mask.may_see`` is true."""
    from rudax.kernels._attention_mask import Ids, Mask

    p, r, g, blk = 64, 16, 4, 16
    branch = np.concatenate(
        [np.zeros(p, np.int32)] + [np.full(r, b, np.int32) for b in range(1, g + 1)]
    )
    t = len(branch)
    mask = Mask(t, t, True, None, branches=True)
    ids = Ids(branch=jnp.asarray(branch[None]))
    run = 0
    for i in range(t // blk):
        first, end = mask.kv_blocks(i * blk, blk, blk)
        for j in range(int(first), int(end)):
            pred = mask.may_see(ids.slice(i * blk, blk), ids.slice(j * blk, blk))
            run += bool(pred)
    # P^2/2 + G (R P + R^2/2) in blocks: the prompt's 4 x 5 / 2 = 10, each branch 4 + 1.
    n_p, n_r = p // blk, r // blk
    assert run == n_p * (n_p + 1) // 2 + g * (n_r * n_p + n_r * (n_r + 1) // 2)


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument
# ----------------------------------------------------------------------------------------------

_Q = jnp.zeros((1, 6, 2, 8))
_KV = jnp.zeros((1, 6, 2, 8))
_BR = np.array([[0, 0, 1, 1, 2, 2]], np.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(branch_ids=_BR[:, :5]), ValueError, r"branch_ids must be \[B, T\] = \(1, 6\)"),
        (dict(branch_ids=_BR.astype(np.float32)), TypeError, "branch_ids must be integers"),
        (dict(branch_ids=_BR.tolist()), TypeError, "branch_ids must be an integer array"),
        (dict(branch_ids=_BR, causal=False), ValueError, "branch_ids needs causal=True"),
        (
            dict(branch_ids=_BR, kv_segment_ids=np.ones((1, 6), np.int32), segment_ids=_BR),
            ValueError,
            "no kv_segment_ids",
        ),
        (
            dict(branch_ids=np.array([[0, 1, 0, 1, 2, 2]], np.int32)),
            ValueError,
            r"branch 1 at index 1\) comes before a prefix token \(branch 0 at index 2\)",
        ),
        (
            dict(branch_ids=np.array([[0, 0, 1, 1, -1, 2]], np.int32)),
            ValueError,
            r"branch_ids must be >= 0 .* branch_ids\[0, 4\] = -1",
        ),
        (
            dict(branch_ids=np.array([[0, 0, 1, 1, 2, 2**32]], np.int64)),
            ValueError,
            r"branch_ids must fit in int32 .* holding 4294967296",
        ),
        (
            dict(segment_ids=np.array([[0, 0, 0, 2**32, 2**32, 2**32]], np.int64)),
            ValueError,
            r"segment_ids must fit in int32 .* holding 4294967296",
        ),
        (dict(branch_ids=_BR, impl="cudnn"), ValueError, "impl='cudnn' cannot .*branch_ids"),
    ],
    ids=[
        "shape", "float", "list", "not-causal", "kv-segments", "branch-before-prefix",
        "negative", "int64-branch", "int64-segment", "cudnn",
    ],
)  # fmt: skip
def test_bad_branch_inputs(kwargs, error, match):
    kwargs = {"causal": True, **kwargs}
    with pytest.raises(error, match=match):
        rk.flash_attention(_Q, _KV, _KV, **kwargs)


def test_branch_layout_checked_per_segment():
    """A segment may start with its prefix after another segment's branches; within one
    segment, a prefix token after a branch token is refused, naming the segment."""
    seg = np.array([[1, 1, 1, 2, 2, 2]], np.int32)
    ok = np.array([[0, 1, 1, 0, 1, 2]], np.int32)
    rk.flash_attention(_Q, _KV, _KV, causal=True, segment_ids=seg, branch_ids=ok)
    bad = np.array([[0, 1, 1, 1, 0, 2]], np.int32)
    with pytest.raises(ValueError, match="of segment 2"):
        rk.flash_attention(_Q, _KV, _KV, causal=True, segment_ids=seg, branch_ids=bad)


def test_traced_branch_ids_are_not_read():
    """Under jit the ids' values are unknown at trace time: no check reads them, and the
    program compiles once for every layout of one shape."""
    f = jax.jit(lambda br: rk.flash_attention(_Q, _KV, _KV, causal=True, branch_ids=br))
    f(jnp.asarray(_BR))
    f(jnp.asarray([[0, 1, 1, 2, 2, 3]], jnp.int32))
    assert f._cache_size() == 1
