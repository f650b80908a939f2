"""The documentation runs: every docstring Example in rudax and examples/, the README's
quickstart and examples/quickstart.py. The README's main job (examples/lm/train.py) takes
minutes: its tiny configurations run in tests/lm/test_train.py."""

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for package in ("rudax", "examples")
    for p in (ROOT / package).rglob("*.py")
    if p.name not in ("__init__.py", "__main__.py")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


PACKAGES = [
    "rudax.optim",
    "rudax.layers",
    "rudax.kernels",
    "rudax.sharding",
    "rudax.checkpoint",
    "rudax.models",
    "rudax.run",
    "rudax.post_train",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_are_documented(package):
    module = importlib.import_module(package)
    assert module.__all__, f"{package}.__all__ is empty"
    for name in module.__all__:
        obj = getattr(module, name)
        assert (obj.__doc__ or "").strip(), f"{package}.{name} has no docstring"


def test_readme_quickstart_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {})


def test_readme_attention_example_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Attention\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (1, 8, 8, 64)
    assert namespace["dq"].shape == (1, 8, 8, 64)
    assert namespace["y"].shape == (2, 1024, 512)


def test_readme_models_example_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Models: Hugging Face checkpoints in, text out\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert len(out) == 2 and all(1 <= len(row) <= 16 for row in out)
    assert all(row[-1] == 2 or len(row) == 16 for row in out)


def test_readme_finetuning_snippet_runs_on_a_folder_with_rudax_imports_only(tmp_path, monkeypatch):
    from flax import nnx

    from rudax.models import LlamaConfig, LlamaForCausalLM, save_pretrained

    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Fine-tune a Hugging Face model\n", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    imported = []
    for keyword, names in re.findall(r"^(from|import) (.+)$", block, flags=re.M):
        modules = [names.split()[0]] if keyword == "from" else names.split(",")
        imported += [m.split()[0].split(".")[0] for m in modules]
    assert imported and set(imported) <= {"rudax", "flax", "jax", "optax"}, imported
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4,
    )  # fmt: skip
    save_pretrained(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), tmp_path / "hf" / "base")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    losses = namespace["losses"]
    assert losses[-1] < losses[0] - 0.01, losses  # the adapters learn the batch
    assert (tmp_path / "adapters" / "mine" / "adapter_model.safetensors").is_file()


def test_readme_main_command_is_the_lm_trainer():
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pip install -e ".[examples]" && python -m examples.lm.train\n' in readme


def test_quickstart_example_runs():
    """examples/quickstart.py, the README's smaller first example, trains and finishes."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "done:" in proc.stdout


def test_readme_shared_prompts_example_runs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Shared prompts: one prompt, many continuations\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    samples, rows = namespace["samples"], namespace["rows"]
    assert [len(t) for t in samples.tokens] == [8] * 4
    assert int(namespace["metrics"]["tokens"]) == rows.num_tokens == 32


def test_readme_post_training_example_runs():
    """DPO steps raise the pairs' margin; the GRPO gradient of the sampled group is finite and
    reaches the adapters."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### DPO and GRPO on a LoRA policy\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    margins = namespace["margins"]
    assert margins[0] == 0.0 and margins[-1] > 0.0, margins  # B starts at 0: policy = reference
    assert int(namespace["metrics"]["completions"]) == 8
    grads = jax.tree.leaves(namespace["grads"])
    assert all(bool(jax.numpy.isfinite(g).all()) for g in grads)
    assert len(set(namespace["rewards"].tolist())) > 1  # the samples differ: a policy gradient
    assert max(float(abs(g).max()) for g in grads) > 1e-3


def test_readme_mesh_load_example_runs():
    """The models example, then the mesh load after it (its names are the example's)."""
    readme = (ROOT / "README.md").read_text()
    models = re.search(r"```python\n(import tempfile\n.*?)```", readme, flags=re.S).group(1)
    section = readme.split("\n### Loading straight onto a mesh\n", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(models + block, "README.md", "exec"), namespace)
    import rudax.sharding as rs

    sharded = namespace["sharded"]
    assert isinstance(sharded.model.layers[0].self_attn.q_proj, rs.ShardedModule)
