"""``flash_attention``'s argument checks: shapes and dtypes of q, k, v, the segment and branch
ids (a shared prefix's layout checked when the ids are concrete), the window, the static
scalars, and what ``impl="cudnn"`` can compute. Each error names the argument and its value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def check_qkv(q: Any, k: Any, v: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"{name} must be a jax.Array or numpy array, got {name}={x!r}")
    shapes = f"q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"flash_attention expects q [batch, time, heads, head_dim] and k, v [batch, "
            f"kv_time, kv_heads, head_dim], got {shapes}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {shapes}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {shapes}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"k's kv_heads must divide q's heads (grouped-query attention), got {shapes}"
        )
    dtypes = f"q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}"
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have the same dtype, got {dtypes}")
    if q.dtype not in _DTYPES:
        # fp8 would pass a floating check, and its probabilities would be rounded to 3 bits.
        raise TypeError(f"q, k and v must be float16, bfloat16, float32 or float64, got {dtypes}")
    return q, k, v


def check_segments(
    segment_ids: Any, kv_segment_ids: Any, b: int, t: int, s: int
) -> tuple[jax.Array | None, jax.Array | None]:
    if segment_ids is None:
        if kv_segment_ids is not None:
            raise ValueError(
                "kv_segment_ids needs segment_ids (the queries' ids), got segment_ids=None"
            )
        return None, None
    if kv_segment_ids is None:
        if s != t:
            raise ValueError(
                f"segment_ids alone needs as many keys as queries; with S={s} keys and T={t} "
                f"queries pass kv_segment_ids [B, S] too"
            )
        kv_segment_ids = segment_ids
    q_seg = _check_ids("segment_ids", segment_ids, (b, t), "[B, T]")
    kv_seg = _check_ids("kv_segment_ids", kv_segment_ids, (b, s), "[B, S]")
    return q_seg, kv_seg


def _check_ids(name: str, ids: Any, shape: tuple[int, int], spec: str) -> jax.Array:
    if not isinstance(ids, jax.Array | np.ndarray):
        raise TypeError(f"{name} must be an integer array {spec}, got {name}={ids!r}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {name}.dtype={ids.dtype}")
    if ids.shape != shape:
        raise ValueError(f"{name} must be {spec} = {shape}, got {name}.shape={ids.shape}")
    wide = ids.dtype.itemsize > 4 or ids.dtype == np.uint32
    if wide and (values := _concrete(ids)) is not None and values.size:
        # The kernels compare int32 ids: a wider id would wrap (ids 0 and 2**32 would merge).
        lo, hi = int(values.min()), int(values.max())
        info = np.iinfo(np.int32)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise ValueError(
                f"{name} must fit in int32 (the kernels compare int32 ids; a wider id wraps "
                f"and merges with another), got {name}.dtype={ids.dtype} holding {bad}"
            )
    return jnp.asarray(ids, jnp.int32)


def _concrete(x: jax.Array | np.ndarray) -> np.ndarray | None:
    """``x``'s values, or None when it is traced (its values are not known yet)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_branches(
    branch_ids: Any, segment_ids: Any, kv_segment_ids: Any, causal: bool, b: int, t: int, s: int
) -> jax.Array | None:
    if branch_ids is None:
        return None
    branch = _check_ids("branch_ids", branch_ids, (b, t), "[B, T]")
    if not causal:
        raise ValueError(
            "branch_ids needs causal=True: a shared prefix is causal self-attention (each "
            "continuation sees the prefix before it), got causal=False"
        )
    if s != t or kv_segment_ids is not None:
        raise ValueError(
            f"branch_ids is for self-attention over one packed row: the keys are the queries' "
            f"tokens, S == T and no kv_segment_ids; got S={s}, T={t}, "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'given'}"
        )
    values = _concrete(branch_ids)
    if values is not None:
        seg_values = None if segment_ids is None else _concrete(segment_ids)
        if segment_ids is None or seg_values is not None:
            _check_branch_layout(values, seg_values)
    return branch


def _check_branch_layout(branch: np.ndarray, segment: np.ndarray | None) -> None:
    """Branch ids >= 0, and in each segment the prefix (branch 0) before every branch."""
    if branch.size and branch.min() < 0:
        row, col = np.argwhere(branch < 0)[0]
        raise ValueError(
            f"branch_ids must be >= 0 (0 the shared prefix), got branch_ids[{row}, {col}] = "
            f"{branch[row, col]}"
        )
    segment = np.zeros_like(branch) if segment is None else segment
    for row in range(branch.shape[0]):
        for seg in np.unique(segment[row]):
            idx = np.flatnonzero(segment[row] == seg)
            br = branch[row, idx]
            if not (br > 0).any() or not (br == 0).any():
                continue
            first_branch = idx[np.argmax(br > 0)]
            last_prefix = idx[np.flatnonzero(br == 0)[-1]]
            if last_prefix > first_branch:
                raise ValueError(
                    f"branch_ids[{row}]: a branch token (branch {branch[row, first_branch]} at "
                    f"index {first_branch}) comes before a prefix token (branch 0 at index "
                    f"{last_prefix}) of segment {seg}; each segment's shared prefix must come "
                    "before its branches"
                )


def check_window(window: Any, t: int, s: int) -> tuple[int, int] | None:
    if window is None:
        return None
    ok = (
        isinstance(window, tuple | list)
        and len(window) == 2
        and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)
    )
    if not ok or int(window[0]) < 0 or int(window[1]) < 0:
        raise ValueError(f"window must be None or (left, right), two ints >= 0, got {window=}")
    # Past T + S a side hides nothing; clamped, the int32 position arithmetic cannot overflow
    # and every wider window shares one compiled program.
    return min(int(window[0]), t + s), min(int(window[1]), t + s)


def check_positive_static(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be None or a Python float, got {name}={value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be None or a finite float > 0, got {name}={value!r}")
    return float(value)


def check_cudnn(q, k, causal, q_seg, branch, softcap, window) -> None:
    why = []
    if q_seg is not None:
        why.append("segment_ids (jax.nn.dot_product_attention's cuDNN path takes no segment ids)")
    if branch is not None:
        why.append("branch_ids")
    if softcap is not None:
        why.append("softcap")
    if window is not None and not (causal and window[1] == 0):
        why.append("a window other than (left, 0) with causal=True (cuDNN's sliding window)")
    if (causal or window is not None) and q.shape[1] != k.shape[1]:
        why.append(
            f"a causal mask or window with T={q.shape[1]} != S={k.shape[1]} (cuDNN aligns the "
            f"mask top-left, flash_attention bottom-right)"
        )
    if why:
        raise ValueError(
            f"impl='cudnn' cannot compute this attention: {'; '.join(why)}. Pass impl='auto'."
        )
