"""python -m examples.lm.export: a run's weights and tokenizer as a folder transformers loads.

The exported model computes the run's last validation loss in transformers, and
AutoTokenizer stops generation at the corpus's end-of-text token. An FSDP run (its
checkpoint holds flat shards) and an MoE run (a Mixtral) are exported; conftest's
exported_run, used by test_hf_init.py and the fine-tuning tests, is a one-device dense run.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from examples.lm import export, train
from examples.lm.config import build_parser
from examples.lm.prepare import open_split
from tests.lm.conftest import TINY

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_val_loss(out, data_dir):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.dtype == torch.float32
    ce, n = 0.0, 0
    loader = open_split(data_dir, "val", seq_len=16, batch_size=8, seed=0)
    for batch in loader.eval_batches(2):  # TINY's --seq-len, --batch-size, --eval-batches
        batch = torch.tensor(batch.astype(np.int64))
        with torch.no_grad():
            logits = hf_model(batch[:, :-1]).logits.double()
        ce += float(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
            )
        )
        n += batch[:, 1:].numel()
    return ce / n


@pytest.mark.parametrize("flags", [["--mesh", "fsdp=8"], ["--moe"]], ids=["fsdp", "moe"])
def test_transformers_computes_the_runs_validation_loss(data, tmp_path, flags):
    if "--mesh" in flags and jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    run, out = tmp_path / "run", tmp_path / "hf"
    f32 = ["--param-dtype", "float32", "--compute-dtype", "float32", "--optimizer", "adamw"]
    short = ["--steps", "3", "--eval-every", "3", "--checkpoint-every", "2"]
    summary = train.main([*data, *TINY, *short, *f32, *flags, "--run-dir", str(run)])
    result = export.main([str(run), str(out)])
    assert result["step"] == 3  # the latest checkpoint: the weights validated last
    data_dir = Path(data[data.index("--data-dir") + 1])
    assert (out / "tokenizer.json").read_bytes() == (data_dir / "tokenizer.json").read_bytes()
    eot = json.loads((data_dir / "prepared.json").read_text())["eot_id"]
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == eot
    assert config["model_type"] == ("mixtral" if "--moe" in flags else "llama")
    np.testing.assert_allclose(_hf_val_loss(out, data_dir), summary["val_loss"], rtol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", eot)


def test_errors_name_the_problem_and_write_nothing(data, tmp_path, capsys):
    def error(run_dir):
        with pytest.raises(SystemExit) as e:
            export.main([str(run_dir), str(tmp_path / "out")])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "holds no run (no config.json)" in error(tmp_path / "nothing")
    run = tmp_path / "run"
    run.mkdir()
    write_flags = lambda *flags, **extra: (run / "config.json").write_text(
        json.dumps({**vars(build_parser().parse_args([*data, *TINY, *flags])), **extra})
    )
    write_flags("--data-dir", str(tmp_path / "no-data"))
    assert "the run's data directory" in error(run)
    write_flags()
    assert "has no checkpoints/ directory" in error(run)
    config = json.loads((run / "config.json").read_text())
    del config["model"]  # a run of the trainer's earlier GPT
    (run / "config.json").write_text(json.dumps(config))
    assert "was trained by an earlier examples.lm.train (a GPT)" in error(run)
    assert not (tmp_path / "out").exists()
