"""The benchmark's two kinds of arm: a jitted step in this process, a PyTorch step in a child.

``benchmarks.lm_trainer`` times every arm the same way (``benchmarks._timing.alternate``), so every
arm has the same face: calling it runs one training step, ``warmup(n)`` runs the first ``n``
steps and returns the first one's time (compilation included), the rest's time and the first
step's loss, and ``loss`` is the last step's loss.

* ``JaxArm``: a jitted step and its state (the rudax arm, ``lm_trainer.rudax_arm``; the
  flax+optax arm, ``_flax_llama.flax_arm``). A call dispatches the step asynchronously, as
  training does.
* ``TorchArm``: ``benchmarks/_torch_llama.py`` in a child process, driven over its JSON-lines
  protocol (described in that file's docstring); a call sends "run 1" and waits for the
  answer, so the parent's clock times the torch step like the others. ``torch_spec`` is what
  the child builds, ``torch_python`` the interpreter that runs it: rudax does not depend on
  torch, any Python with torch will do.

``check_reference_config`` refuses, before either reference is built, what the references do
not implement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import rudax.models as rm
from benchmarks._trainer import Recipe

TORCH_REF = Path(__file__).with_name("_torch_llama.py")
# The LlamaConfig fields the references leave out, and the value that switches each off: the
# trainer's flags build a dense Llama without them (an --init-from checkpoint may not).
UNSUPPORTED = {
    "qkv_bias": False,
    "o_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "rope_scaling": None,
    "num_local_experts": None,
}


def check_reference_config(config: rm.LlamaConfig) -> None:
    """Raises ValueError naming the fields of ``config`` that the references do not implement.

    The references are a dense Llama: grouped-query attention with RoPE, SwiGLU, RMSNorm, a
    tied or untied head; no biases, sliding window, Llama 3 RoPE scaling or experts.

    Example:
      >>> from rudax.models import LlamaConfig
      >>> check_reference_config(LlamaConfig.tiny(64, num_key_value_heads=2))
      >>> check_reference_config(LlamaConfig.tiny(64, qkv_bias=True))
      Traceback (most recent call last):
      ...
      ValueError: the benchmark's references implement a dense Llama without biases, ...
    """
    given = {k: getattr(config, k) for k, off in UNSUPPORTED.items() if getattr(config, k) != off}
    if given:
        raise ValueError(
            "the benchmark's references implement a dense Llama without biases, sliding "
            f"window, RoPE scaling or experts; the model has {given}: set them to "
            f"{ {k: UNSUPPORTED[k] for k in given} }"
        )


@dataclasses.dataclass
class JaxArm:
    """A jitted step and its state: calling it runs one step (asynchronously, like training)."""

    step: Callable  # state -> (state, out): one training step, asynchronously dispatched
    state: Any
    read_loss: Callable  # out -> the step's loss (before its update) as a float; syncs
    last: Any = None  # the last step's out

    def __call__(self) -> Any:
        self.state, self.last = self.step(self.state)
        return self.last

    def warmup(self, n: int) -> dict[str, float]:
        """Runs n steps: the first one's time (compilation included) and loss, the rest's time."""
        start = time.perf_counter()
        first_loss = self.read_loss(self())
        first = time.perf_counter() - start
        for _ in range(n - 1):
            self()
        jax.block_until_ready(self.state)
        rest = time.perf_counter() - start - first
        return {"first_s": first, "rest_s": rest, "first_loss": first_loss}

    @property
    def loss(self) -> float:
        return self.read_loss(self.last)


class TorchArm:
    """``_torch_llama.py`` in a child process; calling it runs one step there and waits for it."""

    def __init__(
        self, python: str, spec: dict, workdir: Path, mode: str, *, env: dict | None = None
    ):
        self.mode = mode
        spec_path = workdir / f"spec_{mode}.json"
        spec_path.write_text(json.dumps({**spec, "mode": mode}))
        self.stderr = (workdir / f"stderr_{mode}.txt").open("w+")
        self.proc = subprocess.Popen(
            [python, "-u", str(TORCH_REF), str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            # Extra environment for the child, e.g. host_memory.MALLOC_ENV.
            env=None if env is None else {**os.environ, **env},
        )
        self.ready = self._reply("ready")
        self.loss = math.nan  # the last step's loss

    def _reply(self, event: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            tail = "".join(self.stderr.readlines()[-20:])
            raise RuntimeError(
                f"the torch child ({self.mode}) exited ({self.proc.wait()}):\n{tail}"
            )
        reply = json.loads(line)
        if reply.get("event") != event:
            raise RuntimeError(f"the torch child ({self.mode}) answered {reply}, expected {event}")
        return reply

    def _ask(self, command: str, event: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._reply(event)
        self.loss = reply["loss"]
        return reply

    def __call__(self) -> None:
        self._ask("run 1", "ran")

    def matmul_flops_per_s(self) -> float:
        """The child's best fp32 2048^3 matmul rate (torch.mm), measured now."""
        self.proc.stdin.write("matmul\n")
        self.proc.stdin.flush()
        return self._reply("matmul")["flops_per_s"]

    def warmup(self, n: int) -> dict[str, float]:
        reply = self._ask(f"warmup {n}", "warm")
        return {k: reply[k] for k in ("first_s", "rest_s", "first_loss")}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def torch_spec(recipe: Recipe, *, threads: int, workdir: Path) -> dict:
    """What ``_torch_llama.py`` builds: the model's shape, the trainer's hyperparameters, threads.

    The compute dtype is the spec's. The weights and batch go to the returned ``"arrays"``
    path, an ``.npz`` the caller writes (``_flax_llama.flat_params`` and ``batch``).
    """
    spec, opt = recipe.spec, recipe.optimizer
    config = spec.config
    check_reference_config(config)
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    shape += ("num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
    return {
        "config": {
            **{k: getattr(config, k) for k in (*shape, "rope_theta", "rms_norm_eps")},
            "seq_len": spec.seq_len,
        },
        "hparams": {
            "lr": opt.learning_rate,
            "warmup": opt.warmup_steps,
            "steps": opt.steps,
            "min_lr_ratio": opt.min_lr_ratio,
            "weight_decay": opt.weight_decay,
            "beta1": opt.b1,
            "beta2": opt.b2,
            "eps": opt.eps,
            "clip": opt.max_grad_norm,
        },
        "compute_dtype": spec.dtype.name,
        "threads": threads,
        "arrays": str(workdir / "arrays.npz"),
    }


def torch_python(given: str | None) -> tuple[str | None, str]:
    """The interpreter for the torch arms, or None and the reason they are skipped."""
    if given is not None:
        return given, f"torch arms run by {given}"
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, f"torch arms run by this interpreter ({sys.executable})"
    return None, (
        f"torch arms skipped: no torch in {sys.executable}; install it anywhere with "
        "`pip install torch==2.13.0` and pass --torch-python PATH"
    )
