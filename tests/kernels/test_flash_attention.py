"""rudax.kernels.flash_attention against a float64 NumPy reference written in this file.

The oracle is ``_reference`` below: the spec's visibility rule, a masked softmax and the
analytic gradients of ``sum(out * d_out)``, all in float64 (checked once against jax.grad of a
float64 jnp version). ``rk.flash_attention_reference`` is not used as an oracle.

The Pallas kernels run in interpret mode on CPU (about 1 ms per grid step), so the shapes are
tiny and the blocks small (``SMALL``: 16 queries/keys per Pallas block, 8 per XLA chunk): a
sequence of 24-48 tokens spans two or three blocks, the last one overhanging it.

Tolerances are bounds, not guesses: every floating-point result here is a sum of products,
and a sum computed with relative rounding errors of at most ``eps`` per term is within
``eps * sum(|terms|)`` of the exact one. ``_reference`` computes, beside each result, that
magnitude (the same expression with absolute values), and ``_check`` asserts
``|got - want| <= eps * magnitude`` element by element, with ``eps`` counted from the
arithmetic the spec prescribes (see ``_eps``). The reference takes the op's own rounded
inputs; it does not imitate the op's roundings inside (which probabilities get rounded to
bf16 depends on the blocks' running maxima), it bounds them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk

ON_GPU = jax.default_backend() == "gpu"
# Compiled on a GPU, interpreted elsewhere.
INTERPRET = not ON_GPU
SMALL = rk.FlashAttentionBlock(q=16, kv=16, q_backward=16, kv_backward=16, xla_q=8, xla_kv=8)
# Query and key blocks of different sizes (and XLA chunks that divide nothing): the blocks a
# causal or windowed mask skips are computed from both sizes.
UNEVEN = rk.FlashAttentionBlock(q=32, kv=16, q_backward=16, kv_backward=32, xla_q=5, xla_kv=7)

IMPLS = [
    pytest.param({"impl": "pallas", "interpret": INTERPRET}, id="pallas"),
    pytest.param({"impl": "xla"}, id="xla"),
]

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
UNIT_ROUNDOFF = {jnp.float32: U32, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
DTYPE_IDS = {jnp.float32: "fp32", jnp.bfloat16: "bf16", jnp.float16: "fp16"}


# ----------------------------------------------------------------------------------------------
# The float64 reference
# ----------------------------------------------------------------------------------------------


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _visible(t, s, *, causal, window, q_ids, kv_ids):
    """[B or 1, T, S] bool: query t (at position t + S - T) sees key s (at position s)."""
    pos = np.arange(t)[:, None] + (s - t)
    key = np.arange(s)[None, :]
    vis = np.ones((t, s), bool)
    if causal:
        vis &= key <= pos
    if window is not None:
        left, right = window
        vis &= (pos - left <= key) & (key <= pos + right)
    vis = vis[None]
    if q_ids is not None:
        vis = vis & (q_ids[:, :, None] == kv_ids[:, None, :])
    return vis


def _reference(
    q,
    k,
    v,
    d_out,
    *,
    causal=False,
    segment_ids=None,
    kv_segment_ids=None,
    window=None,
    softcap=None,
    scale=None,
):
    """Attention and the gradients of ``sum(out * d_out)`` in float64, with their magnitudes.

    Returns ``(values, magnitudes, cap_magnitudes, zmax)``: dicts keyed out/dq/dk/dv.
    ``magnitudes`` is each result recomputed with |q|, |k|, |v|, |d_out| and without the
    cancellations (the sum of its terms' absolute values). ``cap_magnitudes`` is the same for
    the gradients with the softcap derivative ``1 - tanh^2`` replaced by 1 (its fp32 rounding
    error is absolute, it does not shrink with the derivative); zero without softcap.
    ``zmax`` bounds |scale * q.k| over the visible pairs (0 when there are none).
    """
    q, k, v, d_out = _f64(q), _f64(k), _f64(v), _f64(d_out)
    b, t, h, kdim = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    scale = 1.0 / math.sqrt(kdim) if scale is None else scale
    q_ids = None if segment_ids is None else np.asarray(segment_ids)
    kv_ids = q_ids if kv_segment_ids is None else np.asarray(kv_segment_ids)
    vis = _visible(t, s, causal=causal, window=window, q_ids=q_ids, kv_ids=kv_ids)[:, None]

    # Query head h reads kv head h // r: np.repeat along the head axis is exactly that.
    kh, vh = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    raw = scale * np.einsum("bthd,bshd->bhts", q, kh)
    if softcap is None:
        z, dz = raw, np.ones_like(raw)
    else:
        tanh = np.tanh(raw / softcap)
        z, dz = softcap * tanh, 1.0 - tanh**2
    z = np.where(vis, z, -np.inf)
    zrow = np.max(z, axis=-1, keepdims=True)
    e = np.where(vis, np.exp(z - np.where(np.isfinite(zrow), zrow, 0.0)), 0.0)
    norm = e.sum(-1, keepdims=True)
    p = e / np.where(norm > 0, norm, 1.0)  # rows that see nothing: p = 0, out = 0
    out = np.einsum("bhts,bshd->bthd", p, vh)

    def heads_to_groups(x_bshd):
        return x_bshd.reshape(b, s, g, r, kdim).sum(axis=3)

    # d/dp of sum(out * d_out) = d_out v^T; through the softmax
    # dz = p * (dp - sum_s p dp) = p * (dp - rowsum(d_out * out)); then the softcap's chain
    # rule d(c tanh(x / c))/dx = 1 - tanh^2, and scores = scale * q k^T.
    dp = np.einsum("bthd,bshd->bhts", d_out, vh)
    delta = np.einsum("bthd,bthd->bht", d_out, out)[..., None]
    draw = p * (dp - delta) * dz
    values = {
        "out": out,
        "dq": scale * np.einsum("bhts,bshd->bthd", draw, kh),
        "dk": heads_to_groups(scale * np.einsum("bhts,bthd->bshd", draw, q)),
        "dv": heads_to_groups(np.einsum("bhts,bthd->bshd", p, d_out)),
    }

    aq, akh, avh, ado = np.abs(q), np.abs(kh), np.abs(vh), np.abs(d_out)
    m_out = np.einsum("bhts,bshd->bthd", p, avh)
    m_pre = p * (
        np.einsum("bthd,bshd->bhts", ado, avh) + np.einsum("bthd,bthd->bht", ado, m_out)[..., None]
    )

    def grad_magnitudes(m_draw):
        return {
            "dq": scale * np.einsum("bhts,bshd->bthd", m_draw, akh),
            "dk": heads_to_groups(scale * np.einsum("bhts,bthd->bshd", m_draw, aq)),
            "dv": heads_to_groups(np.einsum("bhts,bthd->bshd", p, ado)),
        }

    magnitudes = {"out": m_out, **grad_magnitudes(m_pre * dz)}
    zero = {name: np.zeros_like(x) for name, x in values.items()}
    cap_magnitudes = zero if softcap is None else {**zero, **grad_magnitudes(m_pre)}
    cap_magnitudes["dv"] = np.zeros_like(values["dv"])
    zbound = scale * np.einsum("bthd,bshd->bhts", aq, akh)
    zmax = float(np.max(np.where(vis, zbound, 0.0)))
    return values, magnitudes, cap_magnitudes, zmax


def _eps(dtype, *, kdim, t, s, r, zmax):
    """(eps_out, eps_grad): the bound on |got - want| / magnitude, counted from the arithmetic.

    A sum of n terms in fp32 is within n u32 of its magnitude, whatever the order. In fp32
    (every dtype computes scores and softmax statistics in fp32):
      * the score q.k sums K terms: absolute error <= K u32 zmax, which exp turns into a
        relative error of the probabilities, counted twice (numerator and normaliser);
      * dP = d_out v^T and rowsum(d_out * out) sum K terms; the normaliser, p @ v and dS @ k
        sum S; dS^T @ q and p^T @ d_out sum the T queries of each of the R heads of a group.
        Their errors add (to first order): at most 2 (K + S + T R) u32;
      * exp, tanh, the division, the online-max rescaling, the saved log-sum-exp: a few ulps
        each, 32 u32 in all.
    Roundings to the input dtype (unit roundoff u; for fp32 they are more fp32 ulps):
      * out: the probabilities before p @ v, the output: 2 u;
      * gradients: the output that rowsum(d_out * out) reads (its error is the forward's
        2 u) and that product's rounding, dS before dS @ k and dS^T @ q (or the
        probabilities before p^T @ d_out), the per-head results before the GQA sum, the
        result: 6 u.
    """
    u = UNIT_ROUNDOFF[dtype]
    e32 = U32 * (2 * kdim * zmax + 2 * (kdim + s + t * r) + 32)
    return 2 * u + e32, 6 * u + e32


def _check(got, want, bound, what):
    """|got - want| <= bound element by element (a NaN fails), with the worst offender shown."""
    got = np.asarray(got).astype(np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        ratio = np.where(bound > 0, err / np.where(bound > 0, bound, 1.0), np.inf)
        i = tuple(np.unravel_index(np.nanargmax(np.where(bad, ratio, -1.0)), got.shape))
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements outside the bound; worst at {i}: "
            f"got {got[i]!r}, want {want[i]!r}, |err| {err[i]:.3g} > bound {bound[i]:.3g}"
        )


def _bounds(reference, dtype, case):
    """The bound on |got - want| for each of out, dq, dk, dv."""
    _, magnitudes, cap_magnitudes, zmax = reference
    r = case.h // case.g
    eps_out, eps_grad = _eps(dtype, kdim=case.kdim, t=case.t, s=case.kv_len, r=r, zmax=zmax)
    return {
        # The softcap derivative 1 - tanh^2 is computed in fp32 within ~3 u32 absolutely.
        name: (eps_out if name == "out" else eps_grad) * m + 4 * U32 * cap_magnitudes[name]
        for name, m in magnitudes.items()
    }


def _check_all(got, reference, dtype, case):
    bounds = _bounds(reference, dtype, case)
    for name, x in zip(("out", "dq", "dk", "dv"), got, strict=True):
        _check(x, reference[0][name], bounds[name], name)


# ----------------------------------------------------------------------------------------------
# Cases and operands
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem; ``s=None`` means S = T. ``segments``: None, "packed" (one set
    of ids, T == S) or "cross" (q ids and kv ids, some q ids absent from the keys)."""

    name: str
    b: int = 1
    t: int = 24
    s: int | None = None
    h: int = 2
    g: int = 2
    kdim: int = 16
    causal: bool = False
    segments: str | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    scale: float | None = None
    block: rk.FlashAttentionBlock | None = SMALL

    @property
    def kv_len(self) -> int:
        return self.t if self.s is None else self.s

    def options(self, impl_kwargs):
        return {
            **impl_kwargs,
            "causal": self.causal,
            "window": self.window,
            "softcap": self.softcap,
            "scale": self.scale,
            "block": self.block,
        }

    def reference_kwargs(self):
        return {
            "causal": self.causal,
            "window": self.window,
            "softcap": self.softcap,
            "scale": self.scale,
        }


# Run lengths of packed segments (cycled): single-token segments among longer ones.
_RUNS = (1, 7, 1, 11, 4, 13, 1, 3, 2)


def _packed_ids(b, n):
    """[b, n] int32 segment ids: runs of _RUNS (shifted per row), ids from -2 to 4 and
    repeating non-adjacently (an id is a label, not a run: equal ids see each other)."""
    rows = []
    for row in range(b):
        ids, i = [], 0
        while len(ids) < n:
            length = _RUNS[(i + 2 * row) % len(_RUNS)]
            ids += [(5 * i + 3 * row) % 7 - 2] * length
            i += 1
        rows.append(ids[:n])
    return np.asarray(rows, np.int32)


def _segment_ids(case):
    """(segment_ids, kv_segment_ids) as numpy int32 arrays, or (None, None)."""
    if case.segments is None:
        return None, None
    if case.segments == "packed":
        assert case.s is None
        return _packed_ids(case.b, case.t), None
    kv_ids = _packed_ids(case.b, case.kv_len)
    assert case.t <= case.kv_len
    # Each query gets the id of the key at its own position, then some ids no key has:
    # a run of 4 queries (id 99) and the last query (id 42) see nothing.
    q_ids = kv_ids[:, case.kv_len - case.t :].copy()
    q_ids[0, case.t // 3 : case.t // 3 + 4] = 99
    q_ids[0, -1] = 42
    return q_ids, kv_ids


def _operands(case, dtype, seed=0):
    """q, k, v, d_out ~ N(0, 1), drawn in float32 and rounded once to ``dtype``."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    q = draw(case.b, case.t, case.h, case.kdim)
    k = draw(case.b, case.kv_len, case.g, case.kdim)
    v = draw(case.b, case.kv_len, case.g, case.kdim)
    d_out = draw(case.b, case.t, case.h, case.kdim)
    return q, k, v, d_out


def _jnp_ids(ids):
    return None if ids is None else jnp.asarray(ids, jnp.int32)


@functools.partial(jax.jit, static_argnums=6)
def _forward_and_grads(q, k, v, d_out, segment_ids, kv_segment_ids, options):
    """(out, dq, dk, dv) of rk.flash_attention, one compilation per shape and options."""
    kwargs = dict(options)

    def attention(q, k, v):
        return rk.flash_attention(
            q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, **kwargs
        )

    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(d_out))


def _run(case, impl_kwargs, q, k, v, d_out, q_ids=None, kv_ids=None):
    options = tuple(sorted(case.options(impl_kwargs).items()))
    return _forward_and_grads(q, k, v, d_out, _jnp_ids(q_ids), _jnp_ids(kv_ids), options)


def _assert_bits_equal(a, b, what):
    """Exact equality of every element (a signed zero equals the other zero)."""
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what, strict=True)


# Each case is one compiled program per impl and dtype (about a second of compiling, most of
# the time here); the invariance tests below reuse these programs (same shapes and options).
CASES = {
    case.name: case
    for case in [
        Case("plain", b=2, t=40, kdim=32),
        Case("gqa3-scale", t=40, h=6, g=2, scale=0.37),
        Case("gqa8-causal", t=33, h=8, g=1, causal=True),
        Case("t1", t=1, s=37, h=2, g=1, causal=True),
        Case("t1-s1", t=1, h=1, g=1),
        Case("t-lt-s-causal", t=20, s=45, h=4, g=2, causal=True),
        # p(t) = t - 16 < 0 for the first 16 queries: rows that see no key.
        Case("t-gt-s-causal", t=40, s=24, h=2, g=1, causal=True),
        Case("packed", b=2, t=40, h=2, g=1, causal=True, segments="packed"),
        Case("cross-segments", b=2, t=24, s=40, segments="cross"),
        Case("window-5-3", t=40, window=(5, 3)),
        Case("window-0-0-t-lt-s", t=24, s=40, window=(0, 0)),
        Case("window-7-0-causal", t=40, h=4, g=1, causal=True, window=(7, 0)),
        Case("softcap", t=40, kdim=32, causal=True, softcap=2.0),
        Case(
            "everything",
            b=2,
            t=24,
            s=40,
            h=8,
            g=2,
            causal=True,
            segments="cross",
            window=(9, 0),
            softcap=3.0,
            scale=0.3,
        ),
        # The default blocks (64, and the XLA path's own chunks) exceed the sequence.
        Case("default-block", t=40, causal=True, block=None),
        Case("uneven-blocks", t=40, s=45, h=4, g=2, causal=True, window=(20, 0), block=UNEVEN),
        # Scores up to ~116: exp overflows fp32 unless the running maximum is subtracted.
        Case("large-scores", t=40, h=2, g=1, causal=True, scale=8.0),
    ]
}
EVERYTHING = CASES["everything"]

# Low precision runs its own code (the casts of the probabilities, of dS, of the results);
# the masks are the same code in every dtype, so bf16 takes a few cases that between them
# hold every option, and fp16 one.
CASE_DTYPES = [
    pytest.param(case, dtype, id=f"{case.name}-{DTYPE_IDS[dtype]}")
    for case, dtype in [(case, jnp.float32) for case in CASES.values()]
    + [(CASES[name], jnp.bfloat16) for name in ("plain", "gqa8-causal", "packed", "everything")]
    + [(EVERYTHING, jnp.float16)]
]


# ----------------------------------------------------------------------------------------------
# Against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES)
@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_forward_and_grads_match_float64_reference(impl_kwargs, case, dtype):
    q, k, v, d_out = _operands(case, dtype)
    q_ids, kv_ids = _segment_ids(case)
    got = _run(case, impl_kwargs, q, k, v, d_out, q_ids, kv_ids)
    for x, like, name in zip(got, (q, q, k, v), ("out", "dq", "dk", "dv"), strict=True):
        assert x.dtype == dtype and x.shape == like.shape, f"{name}: {x.dtype}{x.shape}"
    reference = _reference(
        q,
        k,
        v,
        d_out,
        segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        **case.reference_kwargs(),
    )
    _check_all(got, reference, dtype, case)


def test_reference_gradients_match_float64_autodiff():
    """The hand-derived NumPy gradients against jax.vjp of a float64 jnp softmax attention."""
    case = EVERYTHING
    q, k, v, d_out = _operands(case, jnp.float32, seed=11)
    q_ids, kv_ids = _segment_ids(case)
    values, *_ = _reference(
        q, k, v, d_out, segment_ids=q_ids, kv_segment_ids=kv_ids, **case.reference_kwargs()
    )
    vis = _visible(
        case.t, case.kv_len, causal=True, window=case.window, q_ids=q_ids, kv_ids=kv_ids
    )[:, None]
    assert (~vis.any(-1)).any() and vis.any(), "the case should have empty and non-empty rows"
    r = case.h // case.g

    def attention(q, k, v):
        kh, vh = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        scores = case.scale * jnp.einsum("bthd,bshd->bhts", q, kh)
        scores = case.softcap * jnp.tanh(scores / case.softcap)
        scores = jnp.where(vis, scores, -jnp.inf)
        row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        e = jnp.where(vis, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
        norm = e.sum(-1, keepdims=True)
        p = e / jnp.where(norm > 0, norm, 1.0)
        return jnp.einsum("bhts,bshd->bthd", p, vh)

    @jax.jit
    def forward_and_grads(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(d_out))

    with jax.enable_x64(True):
        want = forward_and_grads(*(jnp.asarray(_f64(x), jnp.float64) for x in (q, k, v, d_out)))
        for name, w in zip(("out", "dq", "dk", "dv"), want, strict=True):
            assert w.dtype == jnp.float64
            np.testing.assert_allclose(values[name], np.asarray(w), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Masking invariances, bit for bit
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_other_segments_do_not_change_a_token_bit_for_bit(impl_kwargs):
    """The packed-row bug class: a segment's outputs and gradients ignore the other segments.

    The tokens of segment 1 (13-27 in row 0, 17-22 in row 1: across block boundaries) get new
    q, k, v and d_out; every other token's out, dq, dk and dv keep their bits.
    """
    case = CASES["packed"]  # its shapes and options, with the ids below
    ids = np.asarray([[0] * 13 + [1] * 15 + [2] * 12, [3] * 17 + [1] * 6 + [8] * 17], np.int32)
    q, k, v, d_out = _operands(case, jnp.float32, seed=3)
    new = _operands(case, jnp.float32, seed=4)
    inside = jnp.asarray(ids == 1)[:, :, None, None]
    changed = [jnp.where(inside, x, old) for x, old in zip(new, (q, k, v, d_out), strict=True)]
    first = _run(case, impl_kwargs, q, k, v, d_out, ids)
    second = _run(case, impl_kwargs, *changed, ids)
    others = ids != 1
    for a, b, name in zip(first, second, ("out", "dq", "dk", "dv"), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        _assert_bits_equal(a[others], b[others], name)
        # Not vacuous: segment 1's own results did change.
        assert not np.array_equal(a[~others], b[~others]), name


@pytest.mark.parametrize("name", ["window-7-0-causal", "everything"])
@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_hidden_keys_do_not_change_a_query_bit_for_bit(impl_kwargs, name):
    """With a window (left, 0) and causal, a key s reaches only the queries at positions p
    with p - left <= s <= p (and, with segments, the same id): perturbing it keeps every other
    query's out and dq, bit for bit. No query sees a later key, nor one further left than left.

    "window-7-0-causal" has T = S; "everything" has T < S (p(t) = t + 16), segments, softcap.
    """
    case = CASES[name]
    q, k, v, d_out = _operands(case, jnp.float32, seed=5)
    q_ids, kv_ids = _segment_ids(case)
    base = _run(case, impl_kwargs, q, k, v, d_out, q_ids, kv_ids)
    vis = np.broadcast_to(
        _visible(case.t, case.kv_len, causal=True, window=case.window, q_ids=q_ids, kv_ids=kv_ids),
        (case.b, case.t, case.kv_len),
    )
    seen = 0
    for key in (0, 17, 23, case.kv_len - 1):
        # Large values, so that a leak could not hide in rounding.
        k2, v2 = k.at[:, key].set(8.0), v.at[:, key].set(100.0)
        out, dq, *_ = _run(case, impl_kwargs, q, k2, v2, d_out, q_ids, kv_ids)
        sees = vis[:, :, key]  # [B, T]
        seen += sees.sum()
        for what, a, b in (("out", base[0], out), ("dq", base[1], dq)):
            a, b = np.asarray(a), np.asarray(b)
            _assert_bits_equal(a[~sees], b[~sees], f"{what}, key {key}")
            assert not np.array_equal(a[sees], b[sees]) or not sees.any(), f"{what}, key {key}"
    assert seen > 0, "no query saw a perturbed key: the test would prove nothing"


# ----------------------------------------------------------------------------------------------
# Fully masked rows
# ----------------------------------------------------------------------------------------------

MASKED = [
    pytest.param(CASES["t-gt-s-causal"], id="t-gt-s-causal"),
    pytest.param(CASES["cross-segments"], id="absent-ids"),
]


@pytest.mark.parametrize("case", MASKED)
@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_fully_masked_rows_give_zeros_and_no_gradient(impl_kwargs, case):
    q, k, v, d_out = _operands(case, jnp.float32, seed=6)
    q_ids, kv_ids = _segment_ids(case)
    if q_ids is not None:
        q_ids[1, :] = 7  # the whole second sequence sees nothing
    vis = _visible(
        case.t, case.kv_len, causal=case.causal, window=case.window, q_ids=q_ids, kv_ids=kv_ids
    )
    empty = ~np.broadcast_to(vis, (case.b, case.t, case.kv_len)).any(-1)  # [B, T]
    assert empty.any() and not empty.all()
    out, dq, dk, dv = _run(case, impl_kwargs, q, k, v, d_out, q_ids, kv_ids)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(np.asarray(x)).all(), name
    _assert_bits_equal(np.asarray(out)[empty], np.zeros_like(np.asarray(out)[empty]), "out")
    _assert_bits_equal(np.asarray(dq)[empty], np.zeros_like(np.asarray(dq)[empty]), "dq")
    # An empty row sends no gradient to the keys: its d_out does not matter, bit for bit.
    rows = jnp.asarray(empty)[:, :, None, None]
    again = _run(case, impl_kwargs, q, k, v, jnp.where(rows, 1e3, d_out), q_ids, kv_ids)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), again, strict=True):
        _assert_bits_equal(a, b, name)


# ----------------------------------------------------------------------------------------------
# Determinism, compilation, transformations
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_forward_and_backward_are_deterministic(impl_kwargs):
    """Two runs of forward and backward give the same bits (on a GPU, a dQ or dK summed with
    atomics in a varying order would not)."""
    case = EVERYTHING
    q, k, v, d_out = _operands(case, jnp.bfloat16, seed=7)
    q_ids, kv_ids = _segment_ids(case)
    first = _run(case, impl_kwargs, q, k, v, d_out, q_ids, kv_ids)
    second = _run(case, impl_kwargs, q, k, v, d_out, q_ids, kv_ids)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second, strict=True):
        _assert_bits_equal(a, b, name)


class _TraceCounter:
    """Counts jaxpr traces (jit cache misses) while installed, through jax.monitoring."""

    EVENT = "/jax/core/compile/jaxpr_trace_duration"

    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        del duration, kwargs
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_second_call_does_not_retrace(impl_kwargs):
    # Shapes no other test uses, so the first call below traces.
    case = Case("compile-once", b=1, t=19, s=21, h=2, g=1, kdim=16, causal=True)
    first = _operands(case, jnp.float32, seed=8)
    second = _operands(case, jnp.float32, seed=9)
    options = case.options(impl_kwargs)

    def op(q, k, v):
        return rk.flash_attention(q, k, v, **options)

    with _TraceCounter() as traces:
        op(*first[:3])
    assert traces.count >= 1, "the counter saw no trace: it cannot detect a retrace"
    with _TraceCounter() as traces:
        op(*second[:3])
    assert traces.count == 0, f"the second call traced {traces.count} function(s)"

    step = jax.jit(jax.grad(lambda q, k, v: op(q, k, v).sum(), argnums=(0, 1, 2)))
    step(*first[:3])
    step(*second[:3])
    assert step._cache_size() == 1, "the gradient recompiled for new values"


@pytest.mark.parametrize("impl_kwargs", IMPLS)
def test_vmap_of_jit_grad_equals_the_unbatched_calls(impl_kwargs):
    """vmap over an extra leading axis (5-D q, k, v; 3-D ids) of jit(grad) with the output as
    aux equals the loop of unbatched calls (jit of vjp), and both equal the reference.

    Not bit for bit: batching turns XLA's dot products into batched ones, which may sum in
    another order; each result is within the rounding bound of the float64 reference, so two
    of them are within twice that of each other.
    """
    case = CASES["packed"]
    options = case.options(impl_kwargs)
    stacks = [_operands(case, jnp.float32, seed=seed) for seed in (10, 11)]
    q5, k5, v5, d5 = (jnp.stack(xs) for xs in zip(*stacks, strict=True))
    ids = _packed_ids(case.b, case.t)
    ids5 = np.stack([ids, np.roll(ids, 5, axis=1)])

    def loss(q, k, v, d_out, ids):
        out = rk.flash_attention(q, k, v, segment_ids=ids, **options)
        return jnp.sum(out * d_out), out

    def out_and_grads(*args):
        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
        return (out, *grads)

    batched = jax.vmap(jax.jit(out_and_grads))(q5, k5, v5, d5, jnp.asarray(ids5))
    for i in range(2):
        loop = _run(case, impl_kwargs, q5[i], k5[i], v5[i], d5[i], ids5[i])
        reference = _reference(
            q5[i], k5[i], v5[i], d5[i], segment_ids=ids5[i], **case.reference_kwargs()
        )
        bounds = _bounds(reference, jnp.float32, case)
        for name, x, y in zip(("out", "dq", "dk", "dv"), batched, loop, strict=True):
            assert x.shape == (2, *y.shape), name
            _check(x[i], reference[0][name], bounds[name], f"vmap {name}[{i}]")
            _check(y, reference[0][name], bounds[name], f"loop {name}[{i}]")
            _check(x[i], np.asarray(y).astype(np.float64), 2 * bounds[name], f"{name}[{i}]")


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------


def _arrays(b=1, t=8, s=8, h=2, g=2, kdim=16, dtype=jnp.float32):
    return (
        jnp.ones((b, t, h, kdim), dtype),
        jnp.ones((b, s, g, kdim), dtype),
        jnp.ones((b, s, g, kdim), dtype),
    )


_Q, _K, _V = _arrays()
_IDS = jnp.zeros((1, 8), jnp.int32)
_BF = _arrays(dtype=jnp.bfloat16)


def _call(q=_Q, k=_K, v=_V, **kwargs):
    """The call, traced only (jax.eval_shape): the checks must not need values."""
    return lambda: jax.eval_shape(functools.partial(rk.flash_attention, **kwargs), q, k, v)


def _both(a, b):
    """A pattern matching a message that shows both shapes, in either order."""
    a, b = re.escape(f"({a})"), re.escape(f"({b})")
    return f"{a}.*{b}|{b}.*{a}"


BAD = [
    # (id, call, error, match): the message names the argument (and its shape or value).
    ("q-3d", _call(q=jnp.ones((8, 2, 16))), ValueError, r"\bq\b.*\(8, 2, 16\)"),
    ("k-5d", _call(k=jnp.ones((1, 1, 8, 2, 16))), ValueError, r"\bk\b.*\(1, 1, 8, 2, 16\)"),
    # A mismatch between two arrays shows both shapes.
    (
        "kv-mismatch",
        _call(v=jnp.ones((1, 8, 1, 16))),
        ValueError,
        _both("1, 8, 2, 16", "1, 8, 1, 16"),
    ),
    (
        "head-dim",
        _call(*_arrays(kdim=16)[:1], *_arrays(kdim=32)[1:]),
        ValueError,
        _both("1, 8, 2, 16", "1, 8, 2, 32"),
    ),
    (
        "batch",
        _call(*_arrays(b=2)[:1], *_arrays(b=1)[1:]),
        ValueError,
        _both("2, 8, 2, 16", "1, 8, 2, 16"),
    ),
    (
        "gqa",
        _call(*_arrays(h=3)[:1], *_arrays(g=2)[1:]),
        ValueError,
        _both("1, 8, 3, 16", "1, 8, 2, 16"),
    ),
    ("dtypes", _call(k=_K.astype(jnp.bfloat16)), TypeError, r"\bk\b.*bfloat16"),
    ("int", _call(*_arrays(dtype=jnp.int32)), TypeError, r"\bq\b.*int32"),
    ("ids-float", _call(segment_ids=_IDS.astype(jnp.float32)), TypeError, r"segment_ids.*float"),
    (
        "ids-shape",
        _call(segment_ids=jnp.zeros((1, 7), jnp.int32)),
        ValueError,
        r"segment_ids.*\(1, 7\)",
    ),
    ("ids-1d", _call(segment_ids=jnp.zeros(8, jnp.int32)), ValueError, r"segment_ids.*\(8,\)"),
    (
        "kv-ids-shape",
        _call(segment_ids=_IDS, kv_segment_ids=jnp.zeros((1, 5), jnp.int32)),
        ValueError,
        r"kv_segment_ids.*\(1, 5\)",
    ),
    ("kv-ids-alone", _call(kv_segment_ids=_IDS), ValueError, r"kv_segment_ids"),
    (
        "ids-t-ne-s",
        _call(*_arrays(t=4)[:1], *_arrays()[1:], segment_ids=jnp.zeros((1, 4), jnp.int32)),
        ValueError,
        r"kv_segment_ids",
    ),
    ("window-negative", _call(window=(-1, 2)), ValueError, r"window.*-1"),
    ("window-single", _call(window=(3,)), (TypeError, ValueError), r"window.*\(3,\)"),
    ("window-int", _call(window=5), (TypeError, ValueError), r"window.*5"),
    ("window-float", _call(window=(1.5, 2)), (TypeError, ValueError), r"window.*1\.5"),
    ("softcap-zero", _call(softcap=0.0), ValueError, r"softcap.*0"),
    ("softcap-negative", _call(softcap=-1.0), ValueError, r"softcap.*-1"),
    ("scale-zero", _call(scale=0.0), ValueError, r"scale.*0"),
    ("scale-negative", _call(scale=-2.0), ValueError, r"scale.*-2"),
    ("impl", _call(impl="triton"), ValueError, r"impl.*triton"),
    ("cudnn-ids", _call(*_BF, impl="cudnn", segment_ids=_IDS), ValueError, r"segment_ids"),
    ("cudnn-softcap", _call(*_BF, impl="cudnn", softcap=5.0), ValueError, r"softcap"),
    (
        "cudnn-causal-t-ne-s",
        _call(*_arrays(t=4, dtype=jnp.bfloat16)[:1], *_BF[1:], impl="cudnn", causal=True),
        ValueError,
        r"causal",
    ),
    (
        "block-not-power-of-two",
        lambda: rk.flash_attention(
            _Q, _K, _V, impl="pallas", interpret=True, block=rk.FlashAttentionBlock(q=24)
        ),
        ValueError,
        r"\bq\b.*24",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_name_the_argument(call, error, match):
    with pytest.raises(error, match=f"(?s){match}"):
        call()
