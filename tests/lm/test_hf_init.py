"""examples.lm.train --init-from a Hugging Face directory: the weights trained on, resumed, refused.

A tiny run is exported with ``python -m examples.lm.export`` (a LlamaForCausalLM directory
with the data's tokenizer.json); a new run starts from that directory. What the user cares
about is checked after training, not only at setup: the exported weights are what the new run
evaluates at update 0, what it keeps improving on, and what ``--resume`` continues from
without the directory.
"""

import json
import shutil

import pytest

from examples.lm import train
from rudax.run import read_metrics
from tests.lm.conftest import TINY


def _evals(summary):
    return {
        r["step"]: r["val_loss"] for r in read_metrics(summary["metrics"]) if r["kind"] == "eval"
    }


@pytest.fixture
def exported(exported_run):
    """(summary of an 8-update source run, its exported HF directory): conftest's."""
    return exported_run


def _fails(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    return err


def test_a_run_from_an_hf_directory_trains_on_its_weights_and_resumes(exported, data, tmp_path):
    summary, hf_dir = exported
    src = _evals(summary)
    random_init, trained = src[0], src[8]
    flags = [*data, *TINY, "--optimizer", "adamw", "--steps", "4", "--eval-every", "2"]
    # The shape flags of TINY are the checkpoint's own, so they may be given again.
    run = tmp_path / "ft"
    first = train.main(
        [*flags, "--run-dir", str(run), "--init-from", str(hf_dir), "--stop-at", "2"]
    )
    config = json.loads((run / "config.json").read_text())
    assert config["architecture"]["tie_word_embeddings"] is True
    assert config["architecture"]["num_key_value_heads"] == 2
    assert config["architecture"]["eos_token_id"] == 0  # <|endoftext|>, from the export
    got = _evals(first)
    # Update 0 evaluates the exported weights, in the same model: the source's last
    # validation loss, bit for bit.
    assert got[0] == trained
    # --resume rebuilds the same model from the run's config.json alone, no --init-from.
    shutil.move(hf_dir, tmp_path / "moved")  # the directory is not needed to continue
    try:
        resumed = train.main(["--run-dir", str(run), "--resume"])
    finally:
        shutil.move(tmp_path / "moved", hf_dir)
    assert resumed["step"] == 4
    # Two more updates on the same data keep the level: the exported weights were trained on.
    assert resumed["val_loss"] < trained + 0.1 * (random_init - trained), (got, src)


def test_a_run_over_an_fsdp_mesh_reads_the_hf_directory_onto_the_mesh(
    exported, data, tmp_path, monkeypatch, mesh="data=2,fsdp=4"
):
    """--init-from an HF directory with --mesh: the checkpoint is read onto the mesh
    (from_pretrained(mesh=...), never whole), and update 0 evaluates the exported weights."""
    import rudax.models as rm

    summary, hf_dir = exported
    trained = _evals(summary)[8]
    meshes = []
    real = rm.from_pretrained

    def from_pretrained(*args, **kwargs):
        meshes.append(kwargs.get("mesh"))
        return real(*args, **kwargs)

    monkeypatch.setattr(rm, "from_pretrained", from_pretrained)
    flags = [*data, *TINY, "--optimizer", "adamw", "--steps", "2", "--eval-every", "2"]
    out = train.main(
        [*flags, "--run-dir", str(tmp_path / "ft"), "--init-from", str(hf_dir), "--mesh", mesh]
    )
    assert [m is not None and "fsdp" in m.axis_names for m in meshes] == [True]
    got = _evals(out)
    assert abs(got[0] - trained) < 1e-5 * trained  # the exported weights (fp32 gathers)
    # and the updates after it are the one-device run's, to the summation order
    alone = _evals(train.main([*flags, "--run-dir", str(tmp_path / "one"), "--init-from",
                               str(hf_dir)]))  # fmt: skip
    assert abs(got[2] - alone[2]) < 1e-4 * alone[2], (got, alone)


def test_hf_directory_errors_name_the_problem(exported, data, tmp_path, capsys):
    _, hf_dir = exported
    base = [*data, *TINY, "--run-dir", str(tmp_path / "run"), "--init-from"]
    err = _fails([*base, str(hf_dir), "--d-model", "64"], capsys)
    assert "the model's shape is its config.json's; flags differ: --d-model 64" in err
    assert "(the checkpoint has 32)" in err
    err = _fails([*base, str(hf_dir), "--moe"], capsys)
    assert "config.json decides whether the model has experts; drop --moe" in err
    err = _fails([*base, str(hf_dir), "--seq-len", "300"], capsys)
    assert "--seq-len 300 is more than the 16 positions of --init-from" in err

    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzzz"] = len(tokenizer["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    err = _fails([*base, str(other)], capsys)
    assert "its tokenizer.json is not the tokenizer of the data in" in err

    (other / "tokenizer.json").unlink()
    err = _fails([*base, str(other)], capsys)
    assert "it has no tokenizer.json" in err

    config = json.loads((hf_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    err = _fails([*base, str(other)], capsys)
    assert "hidden_act='gelu' is not supported" in err
    assert not (tmp_path / "run").exists()  # nothing was written for a refused start
