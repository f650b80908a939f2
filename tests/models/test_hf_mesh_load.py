"""from_pretrained(..., mesh=mesh): each device's shards read from the files alone equal, bit
for bit, the whole load sharded afterwards (rudax.models.shard), for dense, tied, Qwen2 (biases),
NF4 (quantized block by block, the scales' mean over every process's blocks) and Mixtral
checkpoints, layers one module each or stacked, LoRA added by ``prepare``; and no process
reads a whole tensor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rudax.layers as rl
import rudax.sharding as rs
from rudax.models import LlamaConfig, LlamaForCausalLM, from_pretrained, save_pretrained, shard
from rudax.models._safetensors import SafetensorsFile

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
CONFIGS = {
    "llama": dict(COMMON),
    "tied": dict(COMMON, tie_word_embeddings=True),
    "qwen2": dict(COMMON, model_type="qwen2", qkv_bias=True),
    "mixtral": dict(COMMON, model_type="mixtral", num_local_experts=4),
}


def _checkpoint(tmp_path, kind, param_dtype=jnp.bfloat16):
    config = LlamaConfig(**CONFIGS[kind], param_dtype=param_dtype)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    for _, node in nnx.iter_graph(model):  # norms away from 1, so a misread scale shows
        if isinstance(node, nnx.Param) and node.ndim == 1:
            node.set_value(jax.random.normal(jax.random.key(3), node.shape, node.dtype))
    save_pretrained(model, tmp_path)
    return tmp_path


def _flat(model):
    """{path: host value} of every variable, sharded ones unsharded (stacks as (L, ...))."""
    out = {}
    for path, value in nnx.to_flat_state(nnx.state(model)):
        v = value.get_value()
        out[path] = v.unshard() if isinstance(v, rs.ShardedParameter) else np.asarray(v)
    return out


def _assert_same(got, want):
    a, b = _flat(got), _flat(want)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def _mesh(shape=(8,), names=("fsdp",)):
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("kind", ["llama", "tied", "qwen2", "mixtral"])
@pytest.mark.parametrize("scan", [False, True])
def test_mesh_load_equals_the_whole_load_sharded(tmp_path, kind, scan):
    folder = _checkpoint(tmp_path, kind)
    mesh = _mesh()
    want = shard(from_pretrained(folder, scan_layers=scan), rs.ShardingContext(mesh, "fsdp"))
    got = from_pretrained(folder, scan_layers=scan, mesh=mesh)
    _assert_same(got, want)
    leaf = jax.tree.leaves(nnx.state(got))[0]
    assert leaf.sharding.spec[-1] == "fsdp"


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("rounding", ["cuda", "cpu"])
def test_nf4_quantized_per_shard_equals_the_whole_tensor_quantized(tmp_path, scan, rounding):
    # 192 x 64 projections: 12288 weights, 192 blocks: 24 per device of 8, and the 256-block
    # of absmax spans every device's blocks, so its scale needs them all.
    folder = _checkpoint(tmp_path, "qwen2")
    mesh = _mesh((2, 4), ("data", "fsdp"))
    kw = dict(quantize="nf4", absmax_rounding=rounding, scan_layers=scan)
    want = shard(from_pretrained(folder, **kw), rs.ShardingContext(mesh, "fsdp"))
    got = from_pretrained(folder, mesh=mesh, **kw)
    _assert_same(got, want)
    assert len(jax.tree.leaves(nnx.state(got, rl.Quantized))) == 7 * 4 * (1 if scan else 2)


def test_nf4_shards_that_cut_a_block_still_match(tmp_path, monkeypatch):
    # 3 fsdp ranks over 64 x 192 = 12288 weights: 2048 codes per rank, whole blocks; 192
    # blocks, 64 absmax per rank; with hidden 96 (6144-weight k_proj) the ranks' code
    # slices (1024) end mid-256-block. A 5-device axis splits codes off block boundaries.
    folder = _checkpoint(tmp_path, "llama")
    mesh = _mesh((5,), ("fsdp",))
    # and each process's blocks read and quantized 5 at a time (runs of 2**16 on a real model)
    monkeypatch.setattr("rudax.models._hf_mesh_nf4._READ_BLOCKS", 5)
    want = shard(from_pretrained(folder, quantize="nf4"), rs.ShardingContext(mesh, "fsdp"))
    _assert_same(from_pretrained(folder, quantize="nf4", mesh=mesh), want)


def test_prepare_adds_lora_whose_adapters_start_as_on_the_whole_model(tmp_path):
    folder = _checkpoint(tmp_path, "llama")
    mesh = _mesh()

    def prepare(model):
        return rl.apply_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8,
                             quantize_base="nf4", rngs=nnx.Rngs(5))  # fmt: skip

    whole = from_pretrained(folder, prepare=prepare)
    want = shard(whole, rs.ShardingContext(mesh, "fsdp"))
    got = from_pretrained(folder, prepare=prepare, mesh=mesh)
    _assert_same(got, want)
    assert any(isinstance(n, rl.LoRALinear) for _, n in nnx.iter_graph(whole))


def test_each_process_reads_only_its_shards_bytes(tmp_path, monkeypatch):
    """Two of the 8 devices taken as this process's: what it reads is their share."""
    folder = _checkpoint(tmp_path, "llama")
    read = {"elements": 0, "whole": 0}
    get_elements, get_columns = SafetensorsFile.get_elements, SafetensorsFile.get_columns

    def elements(self, name, start, stop):
        read["elements"] += stop - start
        return get_elements(self, name, start, stop)

    def columns(self, name, start, stop):
        read["elements"] += (stop - start) * self.shape(name)[0]
        return get_columns(self, name, start, stop)

    def whole(self, name):
        read["whole"] += 1
        raise AssertionError(f"read the whole of {name}")

    monkeypatch.setattr(SafetensorsFile, "get_elements", elements)
    monkeypatch.setattr(SafetensorsFile, "get_columns", columns)
    monkeypatch.setattr(SafetensorsFile, "get_tensor", whole)
    mesh = _mesh()
    model = from_pretrained(folder, mesh=mesh)
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert read["whole"] == 0
    # every device's own slice, once each (8 of 8 devices are this process's here)
    assert read["elements"] <= total


def test_a_mesh_without_fsdp_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="'fsdp' axis"):
        from_pretrained(folder, mesh=_mesh((8,), ("data",)))


def test_a_tensor_of_another_shape_is_named(tmp_path):
    folder = _checkpoint(tmp_path, "llama")
    config = (
        (folder / "config.json")
        .read_text()
        .replace('"intermediate_size": 192', '"intermediate_size": 128')
    )
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight has shape \(64, 192\)"):
        from_pretrained(folder, mesh=_mesh())


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_logits_after_a_mesh_load_equal_a_one_device_load(tmp_path, quantize):
    from jax.sharding import PartitionSpec as P

    folder = _checkpoint(tmp_path, "tied")
    mesh = _mesh((2, 4), ("data", "fsdp"))
    ids = np.random.default_rng(0).integers(0, 96, (8, 10)).astype(np.int32)
    whole = from_pretrained(folder, quantize=quantize, param_dtype=jnp.float32)
    want = np.asarray(nnx.jit(lambda m, x: m(x))(whole, jnp.asarray(ids)))
    model = from_pretrained(folder, quantize=quantize, param_dtype=jnp.float32, mesh=mesh)
    graph, state = nnx.split(model)
    rows = P(("data", "fsdp"))
    logits = jax.jit(
        jax.shard_map(
            lambda s, x: nnx.merge(graph, s)(x),
            mesh=mesh,
            in_specs=(rs.shard_specs(state), rows),
            out_specs=rows,
        )
    )(state, jax.device_put(ids, jax.sharding.NamedSharding(mesh, rows)))
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
