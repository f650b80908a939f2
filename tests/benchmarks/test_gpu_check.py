"""benchmarks/gpu_check: the stage logic, the time budgets and the JSON schema, on the CPU
(the GPU machine runs the same driver with the real stages)."""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_determinism, gpu_trainer
from benchmarks.gpu_check import Stage

REPO = Path(__file__).resolve().parents[2]


def _py(code):
    return ("{python}", "-c", code)


def _write_json(name, value):
    """Code that writes ``value`` as ``{out}/<name>.json`` (braces doubled for format)."""
    literal = repr(value).replace("{", "{{").replace("}", "}}")
    return f"import json; json.dump({literal}, open('{{out}}/{name}.json', 'w'))"


def test_each_stage_keeps_its_own_budget_and_the_rest_still_run(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    stages = [
        Stage("first", 10, _py(_write_json("first", {"x": 1})), gpu_check._json_file("first")),
        Stage("broken", 10, _py("raise SystemExit(3)")),
        # Runs past its budget, with a child of its own: both are killed.
        Stage(
            "slow",
            1.5,
            ("bash", "-c", f"sleep 60 & echo $! > {pid_file}; sleep 60"),
        ),
        Stage("after", 10, _py(_write_json("after", {"y": 2})), gpu_check._json_file("after")),
    ]
    start = time.monotonic()
    results = gpu_check.run(stages, tmp_path / "out", total_s=60, min_budget_s=1)
    assert time.monotonic() - start < 20
    by_name = {r["name"]: r for r in results["stages"]}
    assert [r["name"] for r in results["stages"]] == ["first", "broken", "slow", "after"]
    assert by_name["first"]["status"] == "ok" and by_name["first"]["results"] == {"x": 1}
    assert by_name["broken"]["status"] == "failed" and by_name["broken"]["returncode"] == 3
    assert by_name["slow"]["status"] == "timeout" and by_name["slow"]["returncode"] is None
    assert 1.4 < by_name["slow"]["seconds"] < 10
    assert by_name["after"]["status"] == "ok" and by_name["after"]["results"] == {"y": 2}
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # killed with its process group; init reaps it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the slow stage's child {grandchild} outlived its budget")
    assert (tmp_path / "out" / "slow.log").read_text().startswith("$ bash -c")


def test_the_total_cuts_budgets_and_skips_what_no_longer_fits(tmp_path):
    stages = [
        Stage("a", 100, _py("import time; time.sleep(2.5)")),
        Stage("b", 100, _py("import time; time.sleep(30)")),
        Stage("c", 100, _py("pass")),
    ]
    results = gpu_check.run(stages, tmp_path, total_s=gpu_check.RESERVE_S + 5, min_budget_s=1)
    a, b, c = results["stages"]
    assert a["status"] == "ok" and a["budget_s"] <= 5
    # b gets what is left of the total, not its own 100 s, and is stopped there.
    assert b["status"] == "timeout" and b["budget_s"] < 3
    assert c["status"] == "skipped" and c["log"] is None
    assert results["seconds"] < gpu_check.RESERVE_S + 6


def test_results_json_schema_and_summary(tmp_path):
    stages = [Stage("env", 10, _py(_write_json("env", {"jax": "0.11.2", "devices": ["gpu:0"]})),
                    gpu_check._json_file("env"))]  # fmt: skip
    gpu_check.run(stages, tmp_path, total_s=60, min_budget_s=1)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["schema_version"] == gpu_check.SCHEMA_VERSION
    assert set(results) == {"schema_version", "total_budget_s", "seconds", "stages"}
    (stage,) = results["stages"]
    assert set(stage) == {"name", "status", "seconds", "budget_s", "returncode", "log", "results"}
    assert stage["status"] in gpu_check.STATUSES
    text = (tmp_path / "summary.txt").read_text()
    assert "| env | ok |" in text and "jax 0.11.2" in text and "gpu:0" in text


def test_junit_counts(tmp_path):
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.kernels.test_a" name="test_x"><failure/></testcase>'
        '<testcase classname="tests.kernels.test_a" name="test_y"/>'
        "</testsuite></testsuites>"
    )
    counts = gpu_check._junit(tmp_path)
    assert counts["passed"] == 3 and counts["failures"] == 1 and counts["skipped"] == 1
    assert counts["failed_tests"] == ["tests.kernels.test_a::test_x"]
    assert "tests: 3 passed, 1 failed" in gpu_check._tests(counts)[0]
    assert gpu_check._junit(tmp_path / "missing") is None


def test_default_stages_fit_eight_minutes_and_name_what_exists():
    assert [s.name for s in gpu_check.default_stages()] == [
        "env", "tests", "tune", "attention", "trainer", "trainer_1b",
    ]  # fmt: skip
    assert sum(s.budget_s for s in gpu_check.default_stages()) <= 8 * 60
    stages = gpu_check.all_stages()
    names = ["env", "tests", "tune", "attention", "kernels", "trainer", "trainer_1b"]
    names += ["determinism"]
    names += ["embedding", "remat", "finetune_mesh", "shared_prefix", "post_train"]
    assert [s.name for s in stages] == names
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    total = float(re.search(r"--total (\d+)", script).group(1))
    backstop = float(re.search(r"timeout -k \d+ (\d+)", script).group(1))
    assert total < backstop <= 9 * 60
    for stage in stages:
        argv = [a.format(out="OUT", python=sys.executable) for a in stage.command]
        if "-m" in argv:
            module = argv[argv.index("-m") + 1]
            if module != "pytest":
                assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
        for arg in argv:
            if arg.startswith("tests/"):
                assert (REPO / arg).exists(), arg


def test_trainer_stage_runs_here_at_a_tiny_size(tmp_path):
    out = tmp_path / "trainer.json"
    results = gpu_trainer.main(
        ["--preset", "tiny", "--steps", "2", "--peak-size", "128", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == results
    assert results["tokens_per_s"] > 0 and 0 < results["mfu"]
    assert len(results["losses_hex"]) == 4  # first, warm-up, two timed
    assert all(float.fromhex(h) > 0 for h in results["losses_hex"])
    line = gpu_check._trainer(results)[0]
    assert "tokens/s, MFU" in line and "tiny" in line


def test_embedding_stage_runs_here_at_a_tiny_size(tmp_path):
    from benchmarks import embedding_backward

    results = embedding_backward.main(
        ["--vocab", "64", "--features", "8", "--ids", "128", "--rounds", "2", "--iters", "1"]
    )
    assert [r["arm"] for r in results["rows"]] == ["scatter", "sorted", "one-hot"]
    assert "sorted:" in "\n".join(gpu_check._embedding(results))


@pytest.mark.slow  # benchmarks.remat's own test runs it; this, the stage's arguments
def test_remat_stage_runs_here_at_a_tiny_size(tmp_path):
    from benchmarks import remat

    out = tmp_path / "remat.json"
    argv = ["--deep-factor", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "32"]
    argv += ["--n-layers", "2", "--vocab-size", "256"]
    results = remat.main([*argv, "--policies", "full", "--rounds", "2", "--iters", "1",
                          "--json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    rows = results["rows"]
    assert [(r["model"].split()[0], r["layout"], r["policy"]) for r in rows] == [
        (model, layout, policy)
        for model in ("default", "deep")
        for layout in ("unrolled", "scanned")
        for policy in ("none", "full")
    ]
    assert all(r["temp_bytes"] > 0 and r["step_s"] > 0 for r in rows)
    assert rows[0]["temp_vs_none"] == 1.0 and len(rows[1]["step_vs_none"]) == 3
    table = "\n".join(gpu_check._remat(results))
    assert "| deep (4 blocks) | scanned | full |" in table
    # On a CPU: remat lowers the temporary bytes only under the scan (rudax/layers/_remat.py).
    deep = {(r["layout"], r["policy"]): r["temp_bytes"] for r in rows[4:]}
    assert deep["scanned", "full"] < deep["scanned", "none"]


def test_the_depth_table_runs_here_at_a_tiny_size():
    from benchmarks import remat

    argv = ["--depths", "1,2", "--batch-size", "2", "--seq-len", "16", "--d-model", "32"]
    argv += ["--vocab-size", "256"]
    rows = remat.main([*argv, "--rounds", "2", "--iters", "1"])["depths"]
    assert [r["blocks"] for r in rows] == [1, 2]
    assert all(r["unrolled_compile_s"] > 0 and r["scanned_step_s"] > 0 for r in rows)
    assert len(rows[1]["compile_scanned_vs_unrolled"]) == 3


def test_determinism_compares_losses_bit_for_bit():
    def run(losses, ms):
        return {"losses_hex": [float(x).hex() for x in losses], "step_ms": ms}

    same, other = [4.5, 4.25, 4.0], [4.5, 4.25, 4.000001]
    results = gpu_determinism.compare(
        {"default": [run(same, 10.0), run(other, 12.0)],
         "deterministic": [run(same, 15.0), run(same, 15.0)]}
    )  # fmt: skip
    default, det = results["arms"]["default"], results["arms"]["deterministic"]
    assert not default["bitwise"] and default["first_differing_update"] == 3
    assert det["bitwise"] and det["first_differing_update"] is None
    assert results["deterministic_step_time_ratio"] == pytest.approx(15.0 / 11.0)
    lines = gpu_check._determinism({"preset": "mid", **results})
    assert "default: differs at update 3" in lines[1] and "deterministic: bitwise" in lines[2]


def test_the_1b_preset_is_a_1b_class_llama():
    # Built abstractly (no memory): the preset the trainer_1b stage measures on the GPU.
    import jax
    from flax import nnx

    from benchmarks._trainer import trainer_recipe

    recipe = trainer_recipe(**gpu_trainer.PRESETS["1b"])
    model = nnx.eval_shape(lambda: recipe.spec.create(0))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert 1.0e9 < params < 1.1e9, params
    c = recipe.spec.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 64)
    assert recipe.spec.scan_layers and recipe.batch_size * recipe.spec.seq_len == 16384
