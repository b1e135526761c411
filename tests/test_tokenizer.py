"""tokenizer.Tokenizer (the generic fast tokenizer without transformers) against transformers' own class
on the same files: ids, text, special tokens and chat templates must be the same."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_torch import loading, tokenizer

TEXTS = ["hi", "Hello, world!  Two  spaces\tand a tab\n\nnew lines", "émigré naïve 日本語 🙂 <|im_start|>user",
         "def f(x):\n    return x ** 2  # comment", " leading space", "", "1234567890 3.14159e-10"]

# A template that uses what chat templates on the hub use: a namespace, loop controls and variables,
# tojson with options, tools, special-token variables, raise_exception, and template arguments.
TEMPLATE = """{{ bos_token }}{% set ns = namespace(system=false) %}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}
{%- if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
<|im_start|>{{ message['role'] }}
{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message['content'] }}{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{%- if not loop.last %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_end|>
<|im_start|>assistant{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}
{% endif %}{% if ns.system %}[s]{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "easy"}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
     {"role": "tool", "content": "sunny", "name": None}],
]
TOOLS = [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def default_dir():
    return loading.resolve_model(None)


@pytest.fixture(scope="module")
def templated(default_dir, tmp_path_factory):
    """The default model's tokenizer with the template above."""
    path = tmp_path_factory.mktemp("tok")
    shutil.copy(default_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((default_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _both(path):
    from transformers import PreTrainedTokenizerFast

    light = tokenizer.load(path)
    assert isinstance(light, tokenizer.Tokenizer)
    return light, PreTrainedTokenizerFast.from_pretrained(str(path))


def test_default_model_loads_without_transformers(default_dir):
    assert isinstance(loading.load_tokenizer(default_dir), tokenizer.Tokenizer)


def test_ids_text_and_special_tokens_equal_transformers(default_dir):
    light, hf = _both(default_dir)
    for text in TEXTS:
        for special in (True, False):
            assert light(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)[
                "input_ids"], (text, special)
        ids = hf(text)["input_ids"] + [hf.eos_token_id]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                             hf.pad_token_id)
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.all_special_ids == hf.all_special_ids and len(light) == len(hf)
    assert light.get_vocab() == hf.get_vocab()
    assert light.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert light.chat_template == hf.chat_template


@pytest.mark.parametrize("which", ["default", "templated"])
def test_chat_template_renders_as_transformers(which, default_dir, templated):
    light, hf = _both(default_dir if which == "default" else templated)
    for chat in CHATS:
        for gen in (True, False):
            for kwargs in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
                want = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False, **kwargs)
                assert light.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False, **kwargs) == want
                ids = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, **kwargs)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
                assert light.apply_chat_template(chat, add_generation_prompt=gen, **kwargs) == list(ids)
    prefill = CHATS[1][:3]  # the assistant's reply left open, continued by the model
    assert (light.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
            == hf.apply_chat_template(prefill, continue_final_message=True, tokenize=False))
    assert CHATS[2][2]["name"] is None  # the caller's messages untouched (None keys dropped in a copy)


def test_template_errors_surface(templated):
    light, _ = _both(templated)
    with pytest.raises(Exception, match="bad role"):
        light.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    with pytest.raises(ValueError):
        light.apply_chat_template([], tokenize=False)


def test_other_tokenizers_are_left_to_transformers(default_dir, tmp_path):
    """Settings transformers applies on top of tokenizer.json, another class or named templates: None."""
    config = json.loads((default_dir / "tokenizer_config.json").read_text())
    shutil.copy(default_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"add_bos_token": True},
                   {"chat_template": [{"name": "default", "template": "x"}]},
                   {"chat_template": "{% generation %}x{% endgeneration %}"}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | change))
        assert tokenizer.load(tmp_path) is None, change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer.load(tmp_path) is not None
    (tmp_path / "tokenizer.json").unlink()
    assert tokenizer.load(tmp_path) is None


def test_anything_else_goes_to_transformers(default_dir):
    light, hf = _both(default_dir)
    assert light.hf is light.hf  # built once
    assert light.batch_decode([[1, 2]]) == hf.batch_decode([[1, 2]])  # not implemented here: delegated
