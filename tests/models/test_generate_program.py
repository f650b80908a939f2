"""examples/generate.py: the completion transformers' generate gives, from the same folder."""

import pytest
import torch
import transformers
from flax import nnx

import rudax.layers as rl
from examples import generate as program
from rudax.models import from_pretrained
from tests.models.test_hf_files import _hf, _tokenizer_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    _hf(tie=False).save_pretrained(path)
    _tokenizer_folder(path)
    return path


def _reference(folder, text, *, chat=False, model=None):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ref = model or transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    if chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(text)["input_ids"]
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=3)[
            0, len(ids) :
        ]
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_prints_transformers_completion(folder, capsys, chat):
    argv = ["--model", str(folder), "--prompt", "w5 w9 w2", "--max-new-tokens", "12"]
    got = program.main(argv + (["--chat"] if chat else []))
    assert got == _reference(folder, "w5 w9 w2", chat=chat)
    assert capsys.readouterr().out.strip() == got.strip()


def test_with_an_adapter_prints_peft_completion(folder, tmp_path):
    import peft

    model = from_pretrained(folder)
    rl.apply_lora(model, ["q_proj", "up_proj"], rank=4, alpha=8, rngs=nnx.Rngs(0))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rl.LoRALinear):
            node.lora_b.set_value(node.lora_b[...] + 0.3)
    rl.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(folder))
    argv = ["--model", str(folder), "--adapter", str(tmp_path / "adapter")]
    got = program.main([*argv, "--prompt", "w7 w1", "--max-new-tokens", "12"])
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert got == _reference(folder, "w7 w1", model=adapted)
    assert got != _reference(folder, "w7 w1")  # the adapter changed the completion


def test_errors_are_one_line_and_exit_2(folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        program.main(["--model", str(tmp_path), "--prompt", "x"])
    assert e.value.code == 2 and "no tokenizer.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        program.main(["--model", str(folder), "--adapter", str(tmp_path / "no"), "--prompt", "x"])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_bad_base_record_is_named(folder, tmp_path, capsys):
    """An adapter's rudax_base.json (examples.finetune's record of how it held the base) with
    a value it cannot hold is refused on one line naming the file, the field and the value."""
    model = from_pretrained(folder)
    rl.apply_lora(model, ["q_proj"], rank=2, alpha=4, rngs=nnx.Rngs(0))
    rl.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(folder))
    record = tmp_path / "adapter" / "rudax_base.json"
    record.write_text('{"quantize": "nf4", "param_dtype": "float64"}')
    argv = ["--model", str(folder), "--adapter", str(tmp_path / "adapter"), "--prompt", "x"]
    with pytest.raises(SystemExit) as e:
        program.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"error: {record}: param_dtype 'float64' is not one of ('bfloat16'" in err
    # A flag overrides the record's field.
    program.main([*argv, "--param-dtype", "float32", "--max-new-tokens", "2"])
    assert "quantize nf4, param_dtype float32" in capsys.readouterr().err
