"""The catalog of bad inputs to rudax.models: checkpoint folders and config.json files that
are damaged or not what they claim, each refused with a message naming what is wrong."""

import json
import os
import tempfile
from pathlib import Path

from rudax.models import LlamaConfig, from_pretrained
from tests._catalog import Bad, catalog

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4)  # fmt: skip


def _folder(weights: str) -> Path:
    """A checkpoint folder with a good config.json and a ``model.safetensors`` that is
    ``weights``: "loop" (a symlink to itself) or "folder"."""
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    target = folder / "model.safetensors"
    if weights == "loop":
        os.symlink(target, target)
    else:
        target.mkdir()
    return folder


def _config(**change):
    hf = {**CONFIG.to_hf(), **change}
    return lambda: LlamaConfig.from_hf(hf)


NAN_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": float("nan"),
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 512}  # fmt: skip

CASES = [
    # issue 29: both were reported as "no model.safetensors"
    Bad("weights-a-symlink-loop", lambda: from_pretrained(_folder("loop")), ValueError,
        r"model\.safetensors is not a regular file: a folder, a broken symlink or a loop"),
    Bad("weights-a-folder", lambda: from_pretrained(_folder("folder")), ValueError,
        r"model\.safetensors is not a regular file"),
    # issue 29: a bare ZeroDivisionError, and "disagree on factor: nan and nan"
    Bad("config-zero-heads", _config(num_attention_heads=0), ValueError,
        r"num_attention_heads must be > 0, got num_attention_heads=0"),
    Bad("config-nan-rope-factor",
        _config(rope_scaling=NAN_LLAMA3, rope_parameters=NAN_LLAMA3), ValueError,
        r"rope_type='llama3': factor must be a finite number > 0, got factor=nan"),
]  # fmt: skip

test_bad_input = catalog(CASES)
