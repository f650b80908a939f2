"""python -m examples.lm.lora: a LoRA fine-tune of an exported run, checked as a user would.

A tiny run is trained and exported with ``python -m examples.lm.hf export`` (a
LlamaForCausalLM directory with the data's tokenizer.json); the script fine-tunes adapters on
it. After the run: the validation loss went down, the adapter directory loads in
``peft.PeftModel.from_pretrained`` on transformers' model of the export with the logits of the
model the script trained, ``--merged``'s checkpoint gives them in transformers alone, and the
base's files are untouched. Logits agree to max |difference| / max |logit| <= 1e-5 (fp32).
"""

import json
import os
import shutil

import numpy as np
import peft
import pytest
import torch  # the reference extra: required, never skipped (the tests run in CI)
import transformers
from flax import nnx

from examples.lm import lora
from examples.lm.prepare import open_split

# The source run's shapes: 16 positions, vocabulary 300 (the tiny corpus's BPE).
FLAGS = [*("--seq-len", "16", "--batch-size", "8", "--eval-batches", "2", "--steps", "8")]
FLAGS += ["--warmup", "1", "--lr", "1e-2"]
IDS = np.random.default_rng(0).integers(0, 300, size=(2, 16))
TOL = 1e-5


def _rel_err(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _ours(model):
    return np.asarray(nnx.jit(lambda m, ids: m(ids)[0])(model, IDS), np.float64)


def _theirs(torch_model):
    with torch.no_grad():
        return torch_model(torch.tensor(IDS)).logits.double().numpy()


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture
def base(exported_run):
    """(the export of an 8-update source run, in bf16 as the trainer stores it, its val loss)."""
    summary, hf_dir = exported_run
    return hf_dir, summary["val_loss"]


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_the_adapter_lowers_the_loss_and_loads_in_peft(base, data, tmp_path, capsys):
    base, source_val_loss = base
    before = _snapshot(base)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    flags = [*data, *FLAGS, "--grad-accum", "2", "--merged", str(merged)]
    summary = lora.main([str(base), str(adapter), *flags])
    out = capsys.readouterr().out
    assert "validation loss before: " in out and "validation loss after: " in out
    assert "tokens/s" in out and summary["tokens_per_s"] > 0
    # The trainer's validation loss (the same batches): separate q/k/v round unlike fused qkv.
    assert summary["val_loss_before"] == pytest.approx(source_val_loss, abs=2e-4)
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.005, summary
    assert _snapshot(base) == before  # the base directory is only read: same files, same bytes

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.0)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert summary["adapted"] == [f"model.layers.0.self_attn.{p}_proj" for p in "qv"]

    ours = _ours(summary["model"])
    torch_base = _hf(base)
    bare = _theirs(torch_base)
    theirs = _theirs(peft.PeftModel.from_pretrained(torch_base, adapter).eval())
    assert _rel_err(ours, theirs) <= TOL, _rel_err(ours, theirs)  # measured 3.3e-7
    assert _rel_err(ours, bare) > 1e-3  # the trained adapter changes the function (0.6)
    merged_logits = _theirs(_hf(merged))
    assert _rel_err(merged_logits, theirs) <= TOL, _rel_err(merged_logits, theirs)  # 4.1e-7
    assert (merged / "tokenizer.json").read_bytes() == before["tokenizer.json"]


def test_dropout_draws_fresh_masks_and_evaluation_is_without_it(base, data, tmp_path):
    hf_dir, _ = base
    adapter = tmp_path / "adapter"
    flags = [*data, *FLAGS, "--steps", "3", "--param-dtype", "bfloat16", "--dropout", "0.5"]
    summary = lora.main([str(hf_dir), str(adapter), *flags])
    counts = [
        int(var.get_value())
        for _, var in nnx.to_flat_state(nnx.state(summary["model"], nnx.RngCount))
    ]
    assert counts == [3, 3]  # q's and v's dropout drew a fresh mask for each microbatch
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_dropout"] == 0.5

    # peft in eval mode (no dropout) on the bf16 base, upcast: the validation loss printed
    # after training, and the trained model's logits.
    theirs = peft.PeftModel.from_pretrained(_hf(hf_dir), adapter).eval()
    val = open_split(data[3], "val", seq_len=16, batch_size=8, seed=0).eval_batches(2)
    with torch.no_grad():
        logits = [theirs(torch.tensor(b[:, :-1])).logits for b in val]
    targets = torch.cat([torch.tensor(b[:, 1:], dtype=torch.long) for b in val])
    ce = torch.nn.functional.cross_entropy(torch.cat(logits).flatten(0, 1), targets.flatten())
    assert summary["val_loss_after"] == pytest.approx(float(ce), rel=TOL)
    assert _rel_err(_ours(summary["model"]), _theirs(theirs)) <= TOL  # measured 4.1e-7


def _fails(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lora.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_bad_flags_and_directories_name_the_problem(base, data, tmp_path, capsys):
    base, _ = base
    out = tmp_path / "adapter"
    ok = [str(base), str(out), *data, *FLAGS]
    err = _fails([*ok, "--warmup", "8"], capsys)
    assert "--warmup must be < --steps, got args.warmup=8, args.steps=8" in err
    assert "argument --rank: must be >= 1, got 0" in _fails([*ok, "--rank", "0"], capsys)
    err = _fails([*ok, "--dropout", "1"], capsys)
    assert "argument --dropout: must be >= 0 and < 1, got 1" in err
    err = _fails([*ok, "--targets", "q_proj,"], capsys)
    assert "argument --targets: expected module names like q_proj,v_proj; got 'q_proj,'" in err
    assert "argument --param-dtype: invalid choice" in _fails([*ok, "--param-dtype", "x"], capsys)

    err = _fails([str(tmp_path), str(out), *data], capsys)
    assert f"HF_DIR {tmp_path}: no config.json with a model_type" in err
    assert f"OUT_DIR {base} is HF_DIR itself" in _fails([str(base), str(base), *data], capsys)
    err = _fails([*ok, "--merged", str(out)], capsys)
    assert "is OUT_DIR: the adapter would apply twice" in err
    (tmp_path / "file").write_text("")
    err = _fails([str(base), str(tmp_path / "file"), *data, *FLAGS], capsys)
    assert f"OUT_DIR {tmp_path / 'file'}: a file, not a directory" in err
    err = _fails([str(base), str(out), "--data-dir", str(tmp_path / "none")], capsys)
    assert f"--data-dir {tmp_path / 'none'}: " in err and "prepared.json is missing" in err

    other = tmp_path / "other"
    shutil.copytree(base, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzzz"] = len(tokenizer["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    err = _fails([str(other), str(out), *data, *FLAGS], capsys)
    assert f"HF_DIR {other}: its tokenizer.json is not the tokenizer of the data in" in err
    assert "--init-from" not in err
    shutil.copy(base / "tokenizer.json", other / "tokenizer.json")
    config = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    err = _fails([str(other), str(out), *data, *FLAGS], capsys)
    assert f"HF_DIR {other}: " in err and "hidden_act='gelu' is not supported" in err

    err = _fails([*ok, "--seq-len", "32"], capsys)
    assert "--seq-len 32: the model has 16 positions (max_position_embeddings" in err
    err = _fails([*ok, "--targets", "wq,wv"], capsys)
    assert "--targets wq,wv: targets=['wq', 'wv'] matches no module of the model" in err
    assert "'model.layers.0.self_attn.q_proj'" in err  # the candidates are named
    assert not out.exists()  # nothing is written for a refused run
    assert sorted(os.listdir(base)) == ["config.json", "model.safetensors", "tokenizer.json"]
