"""rudax.models.ChatTemplate against transformers' apply_chat_template, the reference."""

import json

import pytest
import tokenizers
import transformers

from rudax.models import ChatTemplate, load_chat_template

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# trim_blocks / lstrip_blocks, {% generation %}, tojson and raise_exception all in play
TAGGED = """{% for m in messages %}
  {% if m.role not in ['user', 'assistant', 'system'] %}
    {{ raise_exception('bad role ' + m.role) }}
  {% endif %}
  {% if m.role == 'assistant' %}
<|assistant|>{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
  {% else %}
<|{{ m.role }}|>{{ m.content | tojson }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief. Ünïcode stays."},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3 + 3?"},
    {"role": "assistant", "content": "6"},
]


def _tokenizer(template, tmp_path=None):
    words = ["<unk>", "<s>", "</s>", "hello"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = template
    if tmp_path is not None:
        fast.save_pretrained(tmp_path)
    return fast


@pytest.mark.parametrize("template", [CHATML, LLAMA3, TAGGED], ids=["chatml", "llama3", "tagged"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renders_as_transformers(template, generation_prompt):
    tok = _tokenizer(template)
    chat = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    for n in range(1, len(CONVERSATION) + 1):
        want = tok.apply_chat_template(
            CONVERSATION[:n], tokenize=False, add_generation_prompt=generation_prompt
        )
        assert chat.render(CONVERSATION[:n], add_generation_prompt=generation_prompt) == want


def test_segments_count_the_assistant_turns_with_their_end_marker():
    chat = ChatTemplate(CHATML)
    pieces = chat.segments(CONVERSATION)
    assert "".join(t for t, _ in pieces) == chat.render(CONVERSATION)
    assert [t for t, counted in pieces if counted] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    llama = ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>"})
    counted = [t for t, c in llama.segments(CONVERSATION) if c]
    assert counted == ["4<|eot_id|>", "6<|eot_id|>"]
    assert llama.segments(CONVERSATION)[0][0].startswith("<|begin_of_text|>")


def test_segments_agree_with_transformers_generation_mask():
    # transformers marks {% generation %} spans as the assistant tokens; rudax finds the same
    # text by rendering prefixes (its counted pieces hold the same characters).
    tok = _tokenizer(TAGGED)
    chat = ChatTemplate(TAGGED, {"bos_token": "<s>", "eos_token": "</s>"})
    counted = "".join(t for t, c in chat.segments(CONVERSATION) if c)
    assert counted.replace("\n", "") == "4</s>6</s>"
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert "".join(t for t, _ in chat.segments(CONVERSATION)) == text


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # Drops every assistant turn but the last, as some reasoning templates do.
    rewriting = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(ValueError, match="cannot be told from its context"):
        ChatTemplate(rewriting).segments(CONVERSATION)
    with pytest.raises(ValueError, match="no assistant turn"):
        ChatTemplate(CHATML).segments(CONVERSATION[:2])
    with pytest.raises(Exception, match="bad role tool"):
        ChatTemplate(TAGGED).render([{"role": "tool", "content": "x"}])


def test_loads_the_template_transformers_saves_and_the_4x_spellings(tmp_path):
    _tokenizer(LLAMA3, tmp_path / "v5")
    chat = load_chat_template(tmp_path / "v5")
    assert chat is not None and chat.template == LLAMA3
    assert chat.special_tokens["bos_token"] == "<s>" and chat.special_tokens["eos_token"] == "</s>"
    v4 = tmp_path / "v4"
    v4.mkdir()
    config = {"chat_template": CHATML, "eos_token": {"content": "<|im_end|>", "lstrip": False}}
    (v4 / "tokenizer_config.json").write_text(json.dumps(config))
    chat = load_chat_template(v4)
    assert chat.template == CHATML and chat.special_tokens == {"eos_token": "<|im_end|>"}
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA3}]
    (v4 / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(v4).template == LLAMA3
    (v4 / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(v4) is None
