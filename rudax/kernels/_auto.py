"""What ``impl="auto"`` runs on a GPU: each kernel's Pallas path only where it was measured
faster there than the kernel's own XLA path.

``MEASURED`` is the committed table of those measurements, one row per kernel, copied from
``docs/gpu_results.md`` (``tests/kernels/test_auto.py`` reads both and fails if they
differ, or if ``auto`` would take an arm measured slower). A kernel's row gives each arm's
speed against one baseline, median over alternating rounds: the Pallas arm and the XLA arm
of the same call on the same shapes. ``auto`` takes Pallas for a kernel whose Pallas arm was
measured faster, and the XLA path for one measured slower; off a GPU it is always the XLA
path (``rudax.kernels._compat.resolve_impl``).

Kernels without a row decide for themselves and say so in their docstrings:
``flash_attention``'s Pallas kernels were measured against cuDNN, not against their XLA path
(a blocked loop of jnp), and ``auto`` keeps them on a GPU.

One GPU so far (an H200); a table per GPU name, and a sweep that writes it, come with the
next measurements (issue 42). Until then every GPU takes the H200's choices.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MEASURED", "Measured", "auto_takes_pallas"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """One kernel's measurement: the speeds of its Pallas and XLA arms against a baseline."""

    group: str  # the benchmark's group, as docs/gpu_results.md's table names it
    pallas_arm: str  # the arms' names in that table
    xla_arm: str
    pallas: float  # speed vs the group's baseline (median)
    xla: float

    @property
    def pallas_wins(self) -> bool:
        return self.pallas > self.xla


# docs/gpu_results.md, "Kernels": python -m benchmarks.kernels --rounds 5 --iters 3, one NVIDIA
# H200, jax 0.11.2 (CUDA 13), 2026-12-04, commit 688e8bb.
_RMS = "rms_norm fwd+bwd (8192, 4096) bf16"
_LAYER = "layer_norm fwd+bwd (8192, 4096) bf16"
_SILU = "silu_mul fwd+bwd (8192, 4096) bf16"
_ADAMW = "AdamW step, 125,000,000 fp32 params, clip 1.0"
_NF4 = "nf4_matmul fwd+bwd(dx), x (4096, 4096) bf16, W (4096, 4096): 275 GFLOP"
MEASURED: dict[str, Measured] = {
    "rms_norm": Measured(_RMS, "rms_norm pallas", "rms_norm xla", 1.328, 1.009),
    "layer_norm": Measured(_LAYER, "layer_norm pallas", "layer_norm xla", 2.079, 1.027),
    "silu_mul": Measured(_SILU, "silu_mul pallas", "silu_mul xla", 0.901, 1.043),
    # fused_adamw's two kernels, timed together: the global norm's and the update's
    "adamw_update": Measured(_ADAMW, "fused_adamw pallas", "fused_adamw xla", 0.590, 0.973),
    "global_norm": Measured(_ADAMW, "fused_adamw pallas", "fused_adamw xla", 0.590, 0.973),
    "nf4_matmul": Measured(_NF4, "nf4_matmul pallas", "nf4_matmul xla", 0.298, 1.000),
}


def auto_takes_pallas(kernel: str) -> bool:
    """Whether ``impl="auto"`` runs ``kernel``'s Pallas path on a GPU: measured faster, or
    not in the table (the kernel decides)."""
    measured = MEASURED.get(kernel)
    return measured is None or measured.pallas_wins
