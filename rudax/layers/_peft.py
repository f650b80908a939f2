"""PEFT LoRA adapter files: adapter_config.json and adapter_model.safetensors, out and in."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from rudax._validation import check_bool
from rudax.layers._apply_lora import (
    ModuleNames,
    apply_lora,
    named_modules,
    plan_lora,
    target_matcher,
)
from rudax.layers._lora import LoRALinear
from rudax.layers._merge_lora import lora_modules

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# peft's key layout (get_peft_model_state_dict without the adapter name, under PeftModel's
# base_model.model prefix); torch's nn.Linear weights are [out, in], so A is [r, in] and B
# [out, r], the transposes of LoRALinear's [in, r] and [r, out].
_PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.(?P<name>.+)\.lora_(?P<which>[AB])\.weight")

_RULES = {False: "alpha/rank", True: "alpha/sqrt(rank)"}  # by use_rslora

# Fields read for the math, checked one by one below.
_READ = {"peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout"}
# Fields that change nothing once the adapter's weights are loaded: bookkeeping, the training
# mode, and the configs of initializers (init_lora_weights itself is checked).
_INERT = {
    "auto_mapping",
    "base_model_name_or_path",
    "corda_config",
    "ensure_weight_tying",
    "eva_config",
    "inference_mode",
    "init_lora_weights",
    "loftq_config",
    "lora_ga_config",
    "megatron_core",
    "peft_version",
    "qalora_group_size",
    "revision",
    "runtime_config",
    "task_type",
}
# Initializers that leave the base weights as they are; the others (pissa, olora, corda,
# loftq, lora_ga) rewrite the base, so their adapter only fits that rewritten base, and mica
# is a LoRA variant.
_PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva")


def _config(
    model: nnx.Module,
    names: ModuleNames | None,
    base_model_name_or_path: str | None,
    task_type: str | None,
) -> tuple[list[Any], dict[str, Any]]:
    loras = lora_modules(model, names)
    if not loras:
        raise ValueError(
            "save_adapter: the model has no LoRALinear layer with a name (apply_lora first; "
            "names must name the adapted layers)"
        )
    settings = {
        m.name: (m.module.rank, m.module.alpha, m.module.scale_rule, m.module.dropout.rate)
        for m in loras
        if isinstance(m.module, LoRALinear)
    }
    if len(set(settings.values())) > 1:
        raise ValueError(
            "save_adapter: peft's adapter_config.json holds one r, lora_alpha, use_rslora and "
            f"lora_dropout, but the layers differ: (rank, alpha, scale_rule, dropout) = {settings}"
        )
    rank, alpha, scale_rule, dropout = next(iter(settings.values()))
    return loras, {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_bias": False,
        "lora_dropout": dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "target_modules": _targets(model, names, sorted(settings)),
        "task_type": task_type,
        "use_dora": False,
        "use_rslora": scale_rule == "alpha/sqrt(rank)",
    }


def _targets(model: nnx.Module, names: ModuleNames | None, adapted: list[str]) -> Any:
    """The shortest target_modules that selects exactly the adapted layers among the model's
    modules: their last name components (``["q_proj", "v_proj"]``) if that is exact, else a
    regex of the full names."""
    everything = [m.name for m in named_modules(model, names)]
    short = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    match = target_matcher(short)
    if [name for name in everything if match(name)] == adapted:
        return short
    return "|".join(re.escape(name) for name in adapted)


def save_adapter(
    model: nnx.Module,
    directory: str | os.PathLike[str],
    *,
    base_model_name_or_path: str | None,
    names: ModuleNames | None = None,
    task_type: str | None = "CAUSAL_LM",
) -> list[str]:
    """Writes the model's LoRA adapters as a peft adapter directory that peft loads as its own.

    Two files, in peft's LoRA layout, for every ``LoRALinear`` with a name ``n`` under
    ``names`` (torch's ``nn.Linear`` stores ``[out, in]``, so each matrix is transposed)::

        adapter_model.safetensors   base_model.model.{n}.lora_A.weight = A.T   [r, in]
                                    base_model.model.{n}.lora_B.weight = B.T   [out, r]
        adapter_config.json         peft_type "LORA", r, lora_alpha, use_rslora
                                    (True for scale_rule "alpha/sqrt(rank)"), lora_dropout,
                                    target_modules, bias "none", task_type, ...

    Tensors keep their storage dtype (bf16 stays bf16). ``target_modules`` is the adapted
    layers' last name components (``["q_proj", "v_proj"]``) when those select exactly the
    adapted layers among the model's modules, else a regex of their full names, so peft
    adapts the same layers. ``peft.PeftModel.from_pretrained(base, directory)`` then computes
    what the rudax model computes. Every layer must share one rank, alpha, scale rule and
    dropout (peft's file holds one of each); an FSDP model is unsharded first.

    Args:
      model: an ``nnx.Module`` with ``LoRALinear`` layers.
      directory: where to write the two files (created if missing, files overwritten).
      base_model_name_or_path: recorded in the config, as peft records the base it was
        trained on (an HF hub id or a path); None writes null.
      names: the ``ModuleNames`` mapping nnx paths to peft names; None for the dotted path.
      task_type: peft's ``task_type`` (``"CAUSAL_LM"``; None for a plain ``PeftModel``).

    Returns:
      The saved layers' names, sorted.

    Example:
      >>> import json, pathlib, tempfile
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> model = nnx.Dict(q_proj=rl.Linear(4, 4, rngs=nnx.Rngs(0)))
      >>> _ = rl.apply_lora(model, ["q_proj"], rank=2, alpha=8.0, rngs=nnx.Rngs(1))
      >>> d = tempfile.mkdtemp()
      >>> rl.save_adapter(model, d, base_model_name_or_path="my/base")
      ['q_proj']
      >>> config = json.loads((pathlib.Path(d) / "adapter_config.json").read_text())
      >>> config["r"], config["lora_alpha"], config["target_modules"]
      (2, 8, ['q_proj'])

    References:
      peft's LoRA, https://huggingface.co/docs/peft/package_reference/lora.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}: {model=}")
    if base_model_name_or_path is not None and not isinstance(base_model_name_or_path, str):
        raise TypeError(
            f"base_model_name_or_path must be a str or None, got {base_model_name_or_path=}"
        )
    if task_type is not None and not isinstance(task_type, str):
        raise TypeError(f"task_type must be a str or None, got {task_type=}")
    loras, config = _config(model, names, base_model_name_or_path, task_type)
    tensors = {}
    for m in loras:
        lora = m.module
        assert isinstance(lora, LoRALinear)
        # Transposed copies in the stored dtype; numpy handles bf16 through ml_dtypes.
        tensors[f"{_PREFIX}{m.name}.lora_A.weight"] = np.ascontiguousarray(lora.lora_a[...].T)
        tensors[f"{_PREFIX}{m.name}.lora_B.weight"] = np.ascontiguousarray(lora.lora_b[...].T)
    os.makedirs(directory, exist_ok=True)
    # "pt": the layout is torch's (weights [out, in]), the reader peft is.
    safetensors.numpy.save_file(
        tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"}
    )
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return [m.name for m in loras]


def _off(value: Any) -> bool:
    """A peft field left at its default 'feature off' value."""
    return value is None or value is False or value in ({}, [], "")


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in config:
            raise ValueError(f"{path}: missing field {field!r}")
    r, alpha = config["r"], config["lora_alpha"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"{path}: r must be a positive int, got r={r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{path}: lora_alpha must be a number > 0, got lora_alpha={alpha!r}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{path}: use_rslora must be true or false, got {config['use_rslora']!r}")
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"{path}: lora_dropout must be in [0, 1), got lora_dropout={dropout!r}")
    init = config.get("init_lora_weights", True)
    if not any(init is p if isinstance(p, bool) else init == p for p in _PLAIN_INITS):
        raise ValueError(
            f"{path}: init_lora_weights={init!r} is not supported: that initializer rewrites the "
            "base weights (or is a LoRA variant), so the adapter does not fit the original "
            "base; convert it with peft's path_initial_model_for_weight_conversion first"
        )
    for field, value in sorted(config.items()):
        if field in _READ or field in _INERT:
            continue
        if field == "bias" and value == "none":
            continue
        if not _off(value):
            # fan_in_fan_out, bias, use_dora, rank_pattern, alpha_pattern, lora_bias,
            # modules_to_save, layers_to_transform, ... and fields of a newer peft: each
            # changes which layers are adapted or what they compute.
            raise ValueError(
                f"{path}: {field}={value!r} is not supported by rudax.layers.load_adapter (it "
                "changes which layers are adapted or what they compute)"
            )
    return config


def _read_keys(path: str, f: Any) -> dict[str, dict[str, tuple[int, ...]]]:
    """name -> {"A": shape, "B": shape} from the file's header; any other key is refused."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for key in f.keys():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(
                f"{path}: unexpected key {key!r}; a LoRA adapter holds "
                f"{_PREFIX}<module>.lora_A.weight and .lora_B.weight only"
            )
        info = f.get_slice(key)
        if info.get_dtype() not in ("F64", "F32", "F16", "BF16"):
            raise ValueError(f"{path}: {key} has dtype {info.get_dtype()}, not a floating dtype")
        found.setdefault(match["name"], {})[match["which"]] = tuple(info.get_shape())
    return found


def load_adapter(
    model: nnx.Module,
    directory: str | os.PathLike[str],
    *,
    names: ModuleNames | None = None,
    rngs: nnx.Rngs | None = None,
    is_trainable: bool = False,
) -> list[str]:
    """Reads a peft LoRA adapter directory into the model, in place, applying LoRA if needed.

    On a model without LoRA layers, LoRA is first applied as peft's
    ``PeftModel.from_pretrained`` does on a bare base: ``apply_lora(model, target_modules,
    rank=r, alpha=lora_alpha, dropout=lora_dropout, scale_rule=...)`` with the file's
    values (``use_rslora``: ``"alpha/sqrt(rank)"``) and fp32 adapters. On a model that has
    LoRA layers, those must be exactly the file's, with its rank and scale. Then, tensor by
    tensor (``safetensors.safe_open``, never the whole file at once)::

        A = lora_A.weight.T      [in, r]      B = lora_B.weight.T      [r, out]

    each converted to the adapter's storage dtype (as torch's ``load_state_dict`` copies
    into a parameter's dtype).

    The model is then left in inference mode, as peft's ``PeftModel.from_pretrained(base,
    directory, is_trainable=False)`` leaves its model: ``model.eval()``, so every Dropout
    (the adapters' ``lora_dropout`` among them) is deterministic and two calls on the same
    input agree. With ``is_trainable=True`` the mode is left as it is, as in peft (adapters
    this call applies start in training mode, with dropout active), to resume training;
    ``model.train()`` / ``model.eval()`` switch it afterwards either way.

    Refused, naming the field or key: ``peft_type`` other than ``"LORA"``; config fields that
    change the math and that rudax does not implement (``fan_in_fan_out``, ``bias`` other
    than ``"none"``, ``use_dora``, ``rank_pattern``/``alpha_pattern``, ``lora_bias``,
    ``modules_to_save``, ``layers_to_transform``, an initializer that rewrites the base, any
    other field switched on); a key that is not a LoRA matrix, a missing or an unexpected
    key, a shape that is not ``[r, in]`` / ``[out, r]``. The checks run before the model
    changes.

    Args:
      model: an ``nnx.Module``; modified in place.
      directory: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
      names: the ``ModuleNames`` mapping nnx paths to peft names; None for the dotted path.
      rngs: for the dropout masks of layers this call adapts (A is read from the file);
        None for ``nnx.Rngs(0)``.
      is_trainable: False (the default, as in peft) puts the model in eval mode; True
        leaves its mode unchanged, for training the loaded adapters further.

    Returns:
      The loaded layers' names, sorted.

    Example:
      >>> import tempfile
      >>> import numpy as np
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> make = lambda: nnx.Dict(q_proj=rl.Linear(4, 4, rngs=nnx.Rngs(0)))
      >>> trained = make()
      >>> _ = rl.apply_lora(trained, ["q_proj"], rank=2, alpha=8.0, rngs=nnx.Rngs(1))
      >>> trained["q_proj"].lora_b[...] = np.ones((2, 4), np.float32)
      >>> d = tempfile.mkdtemp()
      >>> _ = rl.save_adapter(trained, d, base_model_name_or_path=None)
      >>> model = make()                       # the bare base
      >>> rl.load_adapter(model, d)
      ['q_proj']
      >>> x = np.ones((1, 4), np.float32)
      >>> bool(np.array_equal(model["q_proj"](x), trained["q_proj"](x)))
      True
      >>> model["q_proj"].dropout.deterministic  # inference mode, as peft's default
      True
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}: {model=}")
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs or None, got {type(rngs).__name__}: {rngs=}")
    check_bool("is_trainable", is_trainable)
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"load_adapter: {p} does not exist")
    config = _read_config(config_path)
    r, alpha = config["r"], float(config["lora_alpha"])
    scale_rule = _RULES[config.get("use_rslora", False)]
    scale = alpha / r if scale_rule == "alpha/rank" else alpha / math.sqrt(r)

    try:
        handle = safe_open(weights_path, framework="numpy")
    except Exception as e:  # safetensors' own SafetensorError, whose message names no file
        raise ValueError(
            f"load_adapter: {weights_path} is not a readable safetensors file ({e}): the file is "
            "damaged or was not written by save_adapter or peft"
        ) from e
    with handle as f:
        in_file = _read_keys(weights_path, f)
        existing = lora_modules(model, names)
        if existing:
            layers = {m.name: m.module for m in existing}
            for name, lora in layers.items():
                assert isinstance(lora, LoRALinear)
                if lora.rank != r or not math.isclose(lora.scale, scale, rel_tol=1e-12):
                    raise ValueError(
                        f"{config_path}: {name!r} has rank={lora.rank}, scale={lora.scale} in "
                        f"the model, the file r={r}, scale={scale} ({scale_rule}, "
                        f"lora_alpha={config['lora_alpha']})"
                    )
            plan = None
        else:
            try:
                plan = plan_lora(model, config["target_modules"], names)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{config_path}: target_modules: {e}") from e
            layers = {m.name: m.module for m in plan}
        _check_keys(weights_path, in_file, layers, r)
        if plan is not None:
            apply_lora(
                model,
                config["target_modules"],
                rank=r,
                alpha=alpha,
                dropout=float(config.get("lora_dropout", 0.0)),
                scale_rule=scale_rule,
                names=names,
                rngs=nnx.Rngs(0) if rngs is None else rngs,
            )
        loaded = lora_modules(model, names)
        for m in loaded:
            lora = m.module
            assert isinstance(lora, LoRALinear)
            for which, var in (("A", lora.lora_a), ("B", lora.lora_b)):
                tensor = f.get_tensor(f"{_PREFIX}{m.name}.lora_{which}.weight")
                var.set_value(jnp.asarray(tensor.T, dtype=var.get_value().dtype))
    if not is_trainable:
        # peft's from_pretrained calls eval() on the whole model, base included (issue 28:
        # lora_dropout stayed active, so repeated calls differed).
        model.eval()
    return [m.name for m in loaded]


def _check_keys(
    path: str, in_file: dict[str, dict[str, tuple[int, ...]]], layers: dict[str, Any], r: int
) -> None:
    """Every layer's two keys present with peft's shapes, and no key for any other module."""
    unexpected = sorted(set(in_file) - set(layers))
    if unexpected:
        name = unexpected[0]
        key = f"{_PREFIX}{name}.lora_{sorted(in_file[name])[0]}.weight"
        raise ValueError(
            f"{path}: unexpected key {key}: the model adapts no module named {name!r} "
            f"(unexpected modules: {unexpected}; the model adapts {sorted(layers)})"
        )
    for name, layer in sorted(layers.items()):
        expected = {"A": (r, layer.in_features), "B": (layer.out_features, r)}
        for which, shape in expected.items():
            key = f"{_PREFIX}{name}.lora_{which}.weight"
            got = in_file.get(name, {}).get(which)
            if got is None:
                raise ValueError(f"{path}: missing key {key} (expected shape {list(shape)})")
            if got != shape:
                raise ValueError(
                    f"{path}: {key} has shape {list(got)}, the model expects {list(shape)} "
                    f"([r, in] for lora_A, [out, r] for lora_B)"
                )
