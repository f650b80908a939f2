"""The PyTorch reference of ``examples/lm/model.py``'s dense GPT, for ``benchmarks.lm_trainer``.

The same architecture, written the way a PyTorch user would: ``nn.Embedding`` tied to the
head (``F.linear(x, embed.weight)``), ``nn.RMSNorm``, one bias-free ``qkv`` projection read as
``[q | k | v]``, rotary positions in the "rotate half" layout (channel ``i`` paired with
``i + K/2``, cos/sin tables computed in float64 and stored fp32), ``F.scaled_dot_product_attention``
with ``is_causal=True``, a SwiGLU MLP ``down(silu(gate(x)) * up(x))``, and the mean next-token
cross entropy in fp32. The optimizer step is ``clip_grad_norm_`` then ``torch.optim.AdamW``
(``fused=True``, the fastest CPU implementation; weight decay on the matrices, not the norms
or the embedding, as the trainer) with the trainer's linear-warmup-cosine learning rate through
``LambdaLR``. Parameters are fp32, which are also the optimizer's weights: PyTorch keeps no
bf16 copy (its AMP casts per op); with ``compute_dtype="bfloat16"`` the step runs under
``torch.autocast("cpu", torch.bfloat16)``.

This file imports only torch, numpy and the standard library: ``benchmarks._lm_arms.TorchArm``
runs it for ``bench`` as a child process with a Python that has torch (rudax does not depend
on torch), so the benchmark's arms alternate in one process tree.
The protocol, one JSON object per line::

    argv:    _torch_gpt.py SPEC.json          (config, hyperparameters, mode, threads, arrays)
    child -> {"event": "ready", "torch": version, "threads": n}
    parent -> "warmup N"   child -> {"event": "warm", "first_s": ..., "rest_s": ...,
                                     "first_loss": loss before the first update, "loss": ...}
    parent -> "run N"      child -> {"event": "ran", "seconds": ..., "loss": ...}
    parent -> "matmul"     child -> {"event": "matmul", "flops_per_s": ...}
    parent -> "quit"       (or end of input) the child exits

Weights and the batch come in an ``.npz`` written by the parent: the rudax model's parameters
as fp32 arrays under their ``nnx`` paths (kernels ``[in, out]``, transposed here into
``nn.Linear``'s ``[out, in]``), so every arm starts from the same weights.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm decoder block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, c: dict):
        super().__init__()
        d, h = c["d_model"], c["mlp_hidden"]
        self.n_heads = c["n_heads"]
        self.attn_norm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=c["norm_eps"])
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        # [B, T, H, K] -> [B, H, T, K], the layout scaled_dot_product_attention expects.
        q, k, v = (y.transpose(1, 2) for y in qkv.unbind(2))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates channel pairs ``(i, i + K/2)`` of ``x[B, H, T, K]`` by position, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class GPT(nn.Module):
    """Embedding -> blocks -> RMSNorm -> logits through the embedding's own table."""

    def __init__(self, c: dict):
        super().__init__()
        k = c["d_model"] // c["n_heads"]
        self.embed = nn.Embedding(c["vocab_size"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.norm = nn.RMSNorm(c["d_model"], eps=c["norm_eps"])
        inv_freq = float(c["rope_theta"]) ** (-np.arange(0, k, 2, dtype=np.float64) / k)
        angles = np.arange(c["seq_len"], dtype=np.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.tensor(np.cos(angles), dtype=torch.float32), False)
        self.register_buffer("sin", torch.tensor(np.sin(angles), dtype=torch.float32), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)


def mean_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch[B, T + 1]``, in fp32."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def load_weights(model: GPT, arrays: dict) -> None:
    """Copies the rudax model's parameters (``nnx`` paths, kernels ``[in, out]``) into model."""
    # torch name -> (nnx path, transpose): nn.Linear stores [out, in], rudax's Linear [in, out].
    names = {"embed.weight": ("embed.embedding", False), "norm.weight": ("norm.scale", False)}
    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        names[p + "attn_norm.weight"] = (p + "attn_norm.scale", False)
        names[p + "mlp_norm.weight"] = (p + "mlp_norm.scale", False)
        names[p + "qkv.weight"] = (p + "attn.qkv.kernel", True)
        names[p + "out.weight"] = (p + "attn.out.kernel", True)
        for proj in ("gate", "up", "down"):
            names[p + proj + ".weight"] = (p + "mlp." + proj + ".kernel", True)
    state = model.state_dict()
    sources = {source for source, _ in names.values()}
    if set(names) != set(state) or sources != set(arrays):
        raise ValueError(
            f"weights do not match the model: missing {sorted(sources - set(arrays))}, "
            f"unexpected {sorted(set(arrays) - sources)}"
        )
    with torch.no_grad():
        for name, (source, transpose) in names.items():
            value = torch.from_numpy(np.asarray(arrays[source], np.float32))
            state[name].copy_(value.T if transpose else value)


def warmup_cosine(peak: float, warmup: int, total: int, end: float):
    """The trainer's schedule as a ``LambdaLR`` factor (the learning rate over ``peak``)."""

    def factor(count: int) -> float:
        if count < warmup:
            return count / warmup
        if count >= total:
            return end / peak
        cos = 0.5 * (1 + math.cos(math.pi * (count - warmup) / (total - warmup)))
        return (end + (peak - end) * cos) / peak

    return factor


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
    """Best of ``repeats`` timed fp32 ``[n, n] @ [n, n]`` products, in FLOP/s."""
    a = torch.randn(n, n)
    torch.mm(a, a)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def serve(spec: dict, protocol) -> None:
    """Builds the model and optimizer of ``spec`` and answers the parent's commands."""
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    c, h = spec["config"], spec["hparams"]
    arrays = dict(np.load(spec["arrays"]))
    batch = torch.from_numpy(arrays.pop("batch").astype(np.int64))
    model = GPT(c)
    load_weights(model, arrays)
    # The trainer's decay mask: matrices decay; norms and the embedding (the tied head) do not.
    decays = lambda name, p: p.ndim >= 2 and not name.startswith("embed.")
    decay = [p for n, p in model.named_parameters() if decays(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n, p)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": h["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=h["lr"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(h["lr"], h["warmup"], h["steps"], h["lr"] * h["min_lr_ratio"])
    )
    loss_fn = torch.compile(mean_loss) if spec["mode"] == "compile" else mean_loss
    autocast = spec["compute_dtype"] == "bfloat16"

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), h["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss.detach()

    say = lambda **kw: print(json.dumps(kw), file=protocol, flush=True)
    say(
        event="ready",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    for line in sys.stdin:
        command, _, n = line.strip().partition(" ")
        if command == "quit":
            return
        if command == "matmul":
            say(event="matmul", flops_per_s=matmul_flops_per_s())
            continue
        if command not in ("warmup", "run"):
            raise ValueError(f"unknown command {line!r}")
        n = int(n)
        start = time.perf_counter()
        loss = first_loss = step()  # in warm-up it compiles (mode "compile"): reported apart
        first = time.perf_counter() - start
        for _ in range(n - 1):
            loss = step()
        total = time.perf_counter() - start
        if command == "warmup":
            say(
                event="warm",
                first_s=first,
                rest_s=total - first,
                first_loss=float(first_loss),
                loss=float(loss),
            )
        else:
            say(event="ran", seconds=total, loss=float(loss))


if __name__ == "__main__":
    # The protocol owns the original stdout; anything else printed (torch.compile's logs, a
    # library's print) goes to stderr, where it cannot be read as a reply.
    _protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(sys.argv[1]) as f:
        serve(json.load(f), _protocol)
