"""examples.finetune over a mesh (``examples/finetune/mesh.py``): on 8 devices, data parallel
and FSDP, one process or two, it trains the one-device run's losses; the NF4 base is stored
1/fsdp per device.

Batch size 8: one row per device. ``--dropout 0``: over a mesh each device draws its own masks,
so only without dropout is the one-device run the reference.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from examples.finetune.train import main
from tests._launch import launch_program

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

FLAGS = [
    *("--seq-len", "64", "--batch-size", "8", "--steps", "4", "--warmup", "1"),
    *("--lr", "1e-2", "--eval-every", "2", "--checkpoint-every", "2", "--eval-batches", "2"),
    *("--dropout", "0", "--sample-tokens", "0"),
]


def _flags(base_dir, data_files, run_dir, *extra):
    train, val = data_files
    return [
        *("--base", str(base_dir), "--data", str(train), "--val-data", str(val)),
        *("--run-dir", str(run_dir), *FLAGS, *extra),
    ]


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("tokens_per_s", None)  # the machine's, not the run's
    return rows


@pytest.fixture(scope="module")
def one_device(base_dir, data_files, tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    out = main(_flags(base_dir, data_files, run))
    return out, _rows(run)


def _assert_close(got: list[dict], want: list[dict], rtol: float) -> None:
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if w.get(key) is not None:
                np.testing.assert_allclose(g[key], w[key], rtol=rtol, err_msg=f"{key} {w}")
        assert g.get("counted_tokens") == w.get("counted_tokens")


@pytest.mark.parametrize(
    "mesh",  # both axes in CI, each alone behind -m slow
    [pytest.param("data=8", marks=pytest.mark.slow), "data=2,fsdp=4",
     pytest.param("fsdp=8", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_mesh_trains_the_one_device_losses(base_dir, data_files, tmp_path, one_device, mesh):
    want_out, want = one_device
    out = main(_flags(base_dir, data_files, tmp_path / "run", "--mesh", mesh))
    # fp32 sums in another order (each device's rows, then across devices)
    _assert_close(_rows(tmp_path / "run"), want, rtol=2e-5)
    fsdp = int(mesh.split("fsdp=")[1]) if "fsdp=" in mesh else 1
    # every base array split 1/fsdp (its padding: under one 64-block per weight and device)
    assert out["base_device_bytes"] <= out["base_bytes"] / fsdp + 4096
    assert out["base_device_bytes"] >= out["base_bytes"] / fsdp
    # the adapters came back whole: the same file as the one-device run's, within rounding
    got = rl_state(Path(out["adapter"]))
    ref = rl_state(Path(want_out["adapter"]))
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=k)


def rl_state(adapter_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def _launch(processes: int, args: list[str]) -> tuple[int, str]:
    return launch_program("examples.finetune", processes, args, timeout=300)


def _default_dropout(flags: list[str]) -> list[str]:
    """``flags`` without ``--dropout 0``: LoRA's default dropout, as the README's commands run
    (a dropout key placed over every process's devices failed in device_put before)."""
    i = flags.index("--dropout")
    return flags[:i] + flags[i + 2 :]


def test_two_processes_fsdp_then_resumed_on_one(base_dir, data_files, tmp_path, one_device):
    _, want = one_device
    flags = _flags(base_dir, data_files, tmp_path / "run", "--mesh", "data=2,fsdp=4")
    code, out = _launch(2, [*flags, "--stop-at", "2"])
    assert code == 0, out
    assert "over mesh data=2,fsdp=4 (2 process(es)" in out
    assert "[1] update" not in out  # process 0 alone prints
    code, out = _launch(1, [*flags, "--resume"])
    assert code == 0, out
    _assert_close(_rows(tmp_path / "run"), want, rtol=2e-5)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow  # the FSDP processes' test below samples and saves over processes too
def test_two_data_parallel_processes_sample_and_save_after_training(base_dir, data_files, tmp_path):
    # process 0 alone generates the samples and writes the adapter, from its own copy of the
    # replicated adapters
    flags = _default_dropout(_flags(base_dir, data_files, tmp_path / "run", "--mesh", "data=8"))
    flags = [*flags, "--steps", "2", "--sample-tokens", "4"]
    code, out = _launch(2, flags)
    assert code == 0, out
    assert "[0] update 2" in out and "[1] update 2" not in out
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


def test_fsdp_reads_the_base_onto_the_mesh_samples_over_it_and_merges(
    base_dir, data_files, tmp_path, monkeypatch
):
    # The base is read straight onto the mesh (rudax.models.from_pretrained(..., mesh=)): no
    # process holds it whole while training. The greedy sample before training, generated
    # over the mesh, is the one-device run's; the adapter and the merged model (the base read
    # whole only for the merge, at the end) are the one-device run's within rounding.
    from examples.finetune import base as base_

    extra = ("--steps", "2", "--sample-tokens", "6")
    want = main(_flags(base_dir, data_files, tmp_path / "one", *extra, "--merged",
                       str(tmp_path / "one_merged")))  # fmt: skip
    calls = []
    real = base_.rm.from_pretrained
    monkeypatch.setattr(
        base_.rm, "from_pretrained", lambda *a, **kw: calls.append(kw.get("mesh")) or real(*a, **kw)
    )
    flags = _flags(base_dir, data_files, tmp_path / "run", *extra, "--mesh", "data=2,fsdp=4")
    got = main([*flags, "--merged", str(tmp_path / "merged")])
    assert isinstance(calls[0], jax.sharding.Mesh) and calls[1:] == [None]  # the merge's
    assert got["samples"][0] == want["samples"][0]
    assert set(got["samples"]) == {0, 2}
    for name in ("one", "run"):
        assert (tmp_path / name / "adapter" / "rudax_base.json").exists()
    ref, out = rl_state(Path(want["adapter"])), rl_state(Path(got["adapter"]))
    assert out.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    from safetensors.numpy import load_file

    ref = load_file(str(tmp_path / "one_merged" / "model.safetensors"))
    out = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert out.keys() == ref.keys()
    for k in ref:
        # adapters equal within fp32 rounding, then the sum rounded to the stored dtype: at
        # most one unit in its last place apart (bf16's unit is float32's times 2**16)
        assert out[k].dtype == ref[k].dtype, k
        a, b = out[k].astype(np.float32), ref[k].astype(np.float32)
        unit = np.spacing(np.abs(b)) * (2**16 if ref[k].dtype.name == "bfloat16" else 1)
        assert np.all(np.abs(a - b) <= unit), k


@pytest.mark.long(1)  # minutes: started first (tests/conftest.py)
def test_two_fsdp_processes_sample_over_the_mesh_and_save_the_adapter(
    base_dir, data_files, tmp_path
):
    # every process takes part in generating over the mesh; process 0 alone prints and writes
    flags = _flags(base_dir, data_files, tmp_path / "run", "--mesh", "data=2,fsdp=4")
    flags = _default_dropout(flags)
    code, out = _launch(2, [*flags, "--steps", "2", "--sample-tokens", "4"])
    assert code == 0, out
    assert "[0] sample, before training" in out and "[1] sample" not in out
    assert "[0] sample, update 2" in out
    state = rl_state(tmp_path / "run" / "adapter")
    assert len(state) == 2 * 2 * 7  # A and B of the 7 projections of 2 layers
