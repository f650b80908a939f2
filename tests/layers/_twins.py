"""The small model the LoRA tests compare with peft: a torch ``TorchNet`` and its nnx twin
``Net``, Linear children named like an LLM's (``q_proj``, ``v_proj``, an ``mlp`` of ``up`` and
``down``, optionally a LayerNorm first) in a list of blocks, then a ``head``; ``twin`` copies
the torch weights into the nnx model. Each test file fixes the sizes with its ``Dims``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from torch import nn

import rudax.layers as rl


@dataclasses.dataclass(frozen=True)
class Dims:
    d: int
    h: int
    out: int
    layers: int
    norm: bool  # a LayerNorm before each block's projections


class TorchBlock(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        d, h = dims.d, dims.h
        self.norm = nn.LayerNorm(d) if dims.norm else nn.Identity()
        self.q_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.ModuleDict({"up": nn.Linear(d, h), "down": nn.Linear(h, d)})

    def forward(self, x):
        h = self.norm(x)
        h = x + self.q_proj(h) * torch.sigmoid(self.v_proj(h))
        return h + self.mlp["down"](torch.relu(self.mlp["up"](h)))


class TorchNet(nn.Module):
    def __init__(self, dims: Dims, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([TorchBlock(dims) for _ in range(dims.layers)])
        self.head = nn.Linear(dims.d, dims.out)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Block(nnx.Module):
    def __init__(self, dims: Dims, rngs: nnx.Rngs):
        d, h = dims.d, dims.h
        self.norm = rl.LayerNorm(d, impl="xla") if dims.norm else None
        self.q_proj = rl.Linear(d, d, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)  # flax's own Linear too
        self.mlp = nnx.Dict(up=rl.Linear(d, h, rngs=rngs), down=rl.Linear(h, d, rngs=rngs))

    def __call__(self, x):
        h = x if self.norm is None else self.norm(x)
        h = x + self.q_proj(h) * jax.nn.sigmoid(self.v_proj(h))
        return h + self.mlp["down"](jax.nn.relu(self.mlp["up"](h)))


class Net(nnx.Module):
    def __init__(self, dims: Dims, rngs: nnx.Rngs):
        self.layers = nnx.List([Block(dims, rngs) for _ in range(dims.layers)])
        self.head = rl.Linear(dims.d, dims.out, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def modules_by_name(model: nnx.Module) -> dict[str, nnx.Module]:
    """The model's modules by dotted nnx path, the default ModuleNames."""
    return {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


def twin(dims: Dims, torch_net: TorchNet) -> Net:
    """The nnx Net with torch_net's weights (torch stores a Linear's weight [out, in]); the
    LayerNorms are both at their initial scale 1 and bias 0."""
    model = Net(dims, nnx.Rngs(0))
    mods = modules_by_name(model)
    for name, t in torch_net.named_modules():
        if isinstance(t, nn.Linear):
            mods[name].kernel[...] = jnp.asarray(t.weight.detach().numpy().T)
            if t.bias is not None:
                mods[name].bias[...] = jnp.asarray(t.bias.detach().numpy())
    return model


def at(dims: Dims) -> tuple[Callable[..., Any], ...]:
    """``(TorchNet, Net, Block, twin)`` at one file's sizes: ``TorchNet(seed=0)``,
    ``Net(rngs)``, ``Block(rngs)``, ``twin(torch_net)``."""
    return tuple(functools.partial(f, dims) for f in (TorchNet, Net, Block, twin))
