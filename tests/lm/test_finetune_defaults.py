"""python -m examples.finetune with no --base and no --data: the main job's run, exported to
hf/base, and the standard-library instruction set, made once into data/instructions."""

from __future__ import annotations

import filecmp
import shutil

from examples.finetune import config, instructions, setup
from examples.lm import hf_init
from rudax.run import UsageError


def test_no_base_exports_the_main_jobs_run_once(exported_run, tmp_path, monkeypatch, capsys):
    summary, fixture_hf = exported_run
    monkeypatch.chdir(tmp_path)
    shutil.copytree(summary["run_dir"], tmp_path / "runs" / "base")
    assert setup.find_base(None) == config.DEFAULT_BASE
    assert "exporting runs/base to hf/base" in capsys.readouterr().out
    assert hf_init.is_hf_dir(tmp_path / "hf" / "base")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert filecmp.cmp(tmp_path / "hf" / "base" / name, fixture_hf / name, shallow=False)
    assert setup.find_base(None) == config.DEFAULT_BASE  # there now: not exported again
    assert "exporting" not in capsys.readouterr().out


def test_no_base_and_no_run_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        setup.find_base(None)
    except UsageError as e:
        assert "python -m examples.lm.train --name base" in str(e)
    else:
        raise AssertionError("no UsageError")


def test_no_data_makes_the_instruction_set_once(tmp_path, monkeypatch):
    source = tmp_path / "lib"
    source.mkdir()
    (source / "m.py").write_text(
        "".join(
            f'def f{i}(x):\n    """Return x plus {i}, for the {i}th time today."""\n'
            for i in range(40)
        )
    )
    monkeypatch.setattr(instructions, "stdlib_root", lambda: source)
    monkeypatch.chdir(tmp_path)
    args = config.build_parser().parse_args([])
    train, val, generated = setup.find_data(args)
    assert generated and train == config.DEFAULT_DATA / "train.jsonl"
    assert val == config.DEFAULT_DATA / "val.jsonl"
    rows = train.read_text().splitlines() + val.read_text().splitlines()
    assert len(rows) == 40
    stamp = train.stat().st_mtime_ns
    setup.find_data(args)
    assert train.stat().st_mtime_ns == stamp  # made once
