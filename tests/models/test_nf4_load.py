"""from_pretrained(quantize="nf4"): a checkpoint's projections quantized while read, against
bitsandbytes' codes and transformers' logits; and the host memory streaming takes."""

import json
import subprocess
import sys
import textwrap

import bitsandbytes.functional as bnbf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import rudax.kernels as rk
import rudax.layers as rl
from rudax.models import from_pretrained
from tests.models._reference import IDS, TINY, hf_model
from tests.models._reference import rel_err as _rel_err

BASE = dict(TINY, num_key_value_heads=2)


def _hf_model(kind, seed=0):
    return hf_model(kind, seed, num_key_value_heads=2)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PROJECTIONS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")

_logits = nnx.jit(lambda model, ids: model(ids))


def _linear(layer, proj):
    """A decoder layer's projection by name: transformers' and rudax's paths are the same."""
    return getattr(layer.self_attn if proj in ATTENTION else layer.mlp, proj)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_projections_hold_bitsandbytes_codes_and_logits_match_transformers(tmp_path, kind):
    hf_model = _hf_model(kind).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    # fp32 storage of the bf16 checkpoint (exact), so the only difference from transformers'
    # fp32 model is the arithmetic's rounding; bitsandbytes quantizes bf16 weights in fp32.
    model = from_pretrained(tmp_path, param_dtype=jnp.float32, dtype=jnp.float32, quantize="nf4")
    # transformers' own model of the checkpoint, in fp32 (bf16 -> fp32 is exact).
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for i in range(BASE["num_hidden_layers"]):
        for proj in PROJECTIONS:
            ours = _linear(model.model.layers[i], proj)
            assert isinstance(ours, rl.NF4Linear), (i, proj)
            assert (ours.bias is not None) == (kind == "qwen2" and proj in ATTENTION[:3])
            weight = _linear(hf_model.model.layers[i], proj).weight.detach()  # [out, in], bf16
            codes, _ = bnbf.quantize_4bit(
                weight, blocksize=64, quant_type="nf4", compress_statistics=True
            )
            q = ours.weight
            assert q.shape == tuple(weight.shape) and q.dtype == jnp.float32
            np.testing.assert_array_equal(
                np.asarray(q.codes), codes.numpy().reshape(-1), err_msg=f"{i} {proj}"
            )
            # The dequantized weight goes into transformers' model: its logits are the
            # reference for ours on the quantized base.
            with torch.no_grad():
                w = np.array(rk.nf4_dequantize(q, jnp.float32))  # writable, for torch
                _linear(reference.model.layers[i], proj).weight.copy_(torch.from_numpy(w))
    # The rest is stored in param_dtype, as read.
    emb = hf_model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(model.model.embed_tokens.embedding[...]), emb)
    ours = np.asarray(_logits(model, jnp.asarray(IDS, jnp.int32)), np.float64)
    with torch.no_grad():
        theirs = reference.eval()(torch.tensor(IDS)).logits.double().numpy()
    assert _rel_err(ours, theirs) < 2e-5


# Peak host memory of a streamed load, in a fresh process. The first load compiles; then the
# memory it freed is handed back (gc, malloc_trim), so the measured load must allocate all it
# uses anew. safetensors maps the files, and the pages read count in the resident size as
# file-backed memory (page cache the kernel can drop at any time), so the bound is on the
# anonymous memory (RssAnon, what the process allocated), sampled every millisecond; the
# total high-water mark (VmHWM, from a reset) is reported beside it. A control load that keeps
# a copy of every tensor read (what a non-streamed load holds) must exceed the bound.
_MEASURE = textwrap.dedent(
    """
    import ctypes, gc, json, sys, threading, time
    import jax, jax.numpy as jnp
    from flax import nnx
    import rudax.layers as rl
    from rudax.models import from_pretrained
    from rudax.models._safetensors import SafetensorsFile

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    def give_back():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    def measure():
        give_back()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        anon, rss = status("RssAnon"), status("VmRSS")
        peak, done = [anon], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], status("RssAnon"))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        model = from_pretrained(directory, param_dtype=jnp.bfloat16, quantize="nf4")
        done.set()
        sampler.join()
        peak[0] = max(peak[0], status("RssAnon"))
        return model, peak[0] - anon, status("VmHWM") - rss

    directory = sys.argv[1]
    model = from_pretrained(directory, param_dtype=jnp.bfloat16, quantize="nf4")  # compiles
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    quantized_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, rl.Quantized)))
    del model
    model, anon, rss = measure()
    del model
    # The control: a copy of every tensor read is also kept, as a non-streamed load holds
    # them (the copy kept is not the array returned: on the CPU a device_put adopts a read
    # array's memory, and a kept array the model adopted would cost nothing extra).
    kept, read = [], SafetensorsFile.get_tensor
    SafetensorsFile.get_tensor = lambda self, name: kept.append(read(self, name).copy()) or read(
        self, name
    )
    model, control, _ = measure()
    print(json.dumps({
        "model_bytes": model_bytes,
        "quantized_bytes": quantized_bytes,
        "anon_peak_over_start": anon,
        "rss_peak_over_start": rss,
        "control_anon_peak_over_start": control,
        "control_tensors": len(kept),
    }))
    """
)


def test_streamed_nf4_load_stays_within_the_model_plus_twice_the_largest_tensor(tmp_path, capsys):
    """The streamed load's peak host memory, against the bound and a control.

    The bound: the finished model plus twice the largest tensor (here the untied head, which
    is also transposed: the tensor as read and its device copy). The peak is the kernel's
    own high-water mark of the resident set (VmHWM after clear_refs), which no sampling can
    miss, and the sampled peak of anonymous memory. The control is the same load keeping a
    copy of every tensor read: more than the bound by construction.
    """
    from benchmarks.random_llama import llama_config, write_random_llama

    # Shaped like a real Llama, whose largest tensors are the embedding and the head (32000 x
    # 512 here, 33 MB each in bf16); 44M parameters, 88 MB in bf16.
    config = llama_config(
        vocab_size=32000, hidden_size=512, layers=4, heads=8, kv_heads=2, seq_len=64
    )
    info = write_random_llama(tmp_path / "base", config)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "base")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    bound = m["model_bytes"] + 2 * info["largest_tensor_bytes"]
    with capsys.disabled():
        print(
            f"\nstreamed NF4 load: peak RSS {m['rss_peak_over_start'] / 2**20:.1f} MiB, anon "
            f"{m['anon_peak_over_start'] / 2**20:.1f} MiB over the start; bound (model + 2 x "
            f"largest tensor) {bound / 2**20:.1f} MiB; control "
            f"{m['control_anon_peak_over_start'] / 2**20:.1f} MiB"
        )
    assert m["control_tensors"] == 2 + 9 * config.num_hidden_layers + 1  # every one, once
    assert m["rss_peak_over_start"] <= bound, (m, info)
    assert m["anon_peak_over_start"] <= bound, (m, info)
    assert m["control_anon_peak_over_start"] > bound, (m, info)  # the measure sees copies
    # And it is the saving QLoRA promises: per 64 weights 32 bytes of codes and one absmax
    # code, per 16384 one fp32 scale: 0.258 of the projections' bf16 bytes.
    c = config
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    projections_bf16 = 2 * (info["parameters"] - 2 * c.vocab_size * c.hidden_size - norms)
    assert m["quantized_bytes"] <= 0.27 * projections_bf16, (m, projections_bf16)
