"""The PyTorch reference of the trainer's Llama, for ``benchmarks.lm_trainer``.

The same architecture as ``rudax.models.LlamaForCausalLM`` as the trainer builds it
(``benchmarks/_trainer.py``), written the way a PyTorch user would, under Hugging Face's module
names (``model.layers.0.self_attn.q_proj``): ``nn.Embedding`` tied to the head
(``F.linear(x, embed_tokens.weight)``, or an ``lm_head`` of its own when untied), ``nn.RMSNorm``,
separate bias-free q/k/v projections, rotary positions in the "rotate half" layout (channel
``i`` paired with ``i + K/2``, cos/sin tables computed in float64 and stored fp32),
``F.scaled_dot_product_attention`` with ``is_causal=True`` (grouped-query heads repeated as
transformers' ``repeat_kv``), a SwiGLU MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``, and
the mean next-token cross entropy in fp32. The optimizer step is ``clip_grad_norm_`` then
``torch.optim.AdamW`` (``fused=True``, the fastest CPU implementation; weight decay on the
matrices, not the norms or the token embedding, as the trainer) with the trainer's
linear-warmup-cosine learning rate through ``LambdaLR``. Parameters are fp32, which are also
the optimizer's weights: PyTorch keeps no bf16 copy (its AMP casts per op); with
``compute_dtype="bfloat16"`` the step runs under ``torch.autocast("cpu", torch.bfloat16)``.

This file imports only torch, numpy and the standard library: ``benchmarks._lm_arms.TorchArm``
runs it for ``benchmarks.lm_trainer`` as a child process with a Python that has torch (rudax
does not depend on torch), so the benchmark's arms alternate in one process tree.
The protocol, one JSON object per line::

    argv:    _torch_llama.py SPEC.json        (config, hyperparameters, mode, threads, arrays)
    child -> {"event": "ready", "torch": version, "threads": n}
    parent -> "warmup N"   child -> {"event": "warm", "first_s": ..., "rest_s": ...,
                                     "first_loss": loss before the first update, "loss": ...}
    parent -> "run N"      child -> {"event": "ran", "seconds": ..., "loss": ...}
    parent -> "matmul"     child -> {"event": "matmul", "flops_per_s": ...}
    parent -> "quit"       (or end of input) the child exits

Weights and the batch come in an ``.npz`` written by the parent: the rudax model's parameters
as fp32 arrays under their ``nnx`` paths (``benchmarks._flax_llama.flat_params``: kernels
``[in, out]``, transposed here into ``nn.Linear``'s ``[out, in]``; RMSNorm's ``scale`` and a
table's ``embedding`` are torch's ``weight``), so every arm starts from the same weights.
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


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates channel pairs ``(i, i + K/2)`` of ``x[B, H, T, K]`` by position, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    """Causal self-attention with RoPE, ``num_key_value_heads`` key/value heads."""

    def __init__(self, c: dict):
        super().__init__()
        d, k = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = k
        self.q_proj = nn.Linear(d, self.heads * k, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * k, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * k, bias=False)
        self.o_proj = nn.Linear(self.heads * k, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [B, T, H, K] -> [B, H, T, K], the layout scaled_dot_product_attention expects.
        split = lambda y, n: y.view(b, t, n, self.head_dim).transpose(1, 2)
        q = rope(split(self.q_proj(x), self.heads), cos, sin)
        k = rope(split(self.k_proj(x), self.kv_heads), cos, sin)
        v = split(self.v_proj(x), self.kv_heads)
        if self.heads != self.kv_heads:  # transformers' repeat_kv
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, c: dict):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: ``x += self_attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, c: dict):
        super().__init__()
        d, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding -> decoder layers -> RMSNorm (transformers' ``model``)."""

    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = nn.RMSNorm(c["hidden_size"], eps=c["rms_norm_eps"])
        k = c["head_dim"]
        inv_freq = float(c["rope_theta"]) ** (-np.arange(0, k, 2, dtype=np.float64) / k)
        angles = np.arange(c["seq_len"], dtype=np.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", torch.tensor(np.cos(angles), dtype=torch.float32), False)
        self.register_buffer("sin", torch.tensor(np.sin(angles), dtype=torch.float32), False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``model`` then logits through the embedding's own table (tied) or ``lm_head``'s."""

    def __init__(self, c: dict):
        super().__init__()
        self.model = LlamaModel(c)
        self.tied = c["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.model(tokens)
        return F.linear(h, self.model.embed_tokens.weight) if self.tied else self.lm_head(h)


def mean_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch[B, T + 1]``, in fp32."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def load_weights(model: LlamaForCausalLM, arrays: dict) -> None:
    """Copies the rudax model's parameters (``nnx`` paths, kernels ``[in, out]``) into model.

    The names are the same module paths: ``<module>.kernel`` is ``<module>.weight``
    transposed (``nn.Linear`` stores ``[out, in]``), ``<module>.scale`` and
    ``<module>.embedding`` are ``<module>.weight`` as they are.
    """
    state = model.state_dict()
    names = {}  # torch name -> (nnx name, transpose)
    for source in arrays:
        module, _, leaf = source.rpartition(".")
        if leaf in ("kernel", "scale", "embedding"):
            names[f"{module}.weight"] = (source, leaf == "kernel")
    if set(names) != set(state) or len(names) != len(arrays):
        known = {source for source, _ in names.values()}
        raise ValueError(
            f"weights do not match the model: missing {sorted(set(state) - set(names))}, "
            f"unexpected {sorted(set(names) - set(state) | set(arrays) - known)}"
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
    model = LlamaForCausalLM(c)
    load_weights(model, arrays)
    # The trainer's decay mask: matrices decay (an untied head's table too); norms and the
    # token embedding (also the tied head) do not.
    decays = lambda name, p: p.ndim >= 2 and not name.startswith("model.embed_tokens.")
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
