"""A model's tokenizer on the `tokenizers` library and Jinja alone, for checkpoints whose tokenizer is the
generic fast one (tokenizer_config.json's tokenizer_class TokenizersBackend / PreTrainedTokenizerFast,
which is everything in tokenizer.json).

transformers' own class for such a checkpoint computes the same ids and renders the same chat template
(tests/test_tokenizer.py checks both against it), but importing transformers and building its tokenizer
keeps ~40 MB resident where the `tokenizers` library's own keeps ~18 MB (docs/performance.md, "Memory").
What this class does not do itself (a grammar library that wants a Hugging Face tokenizer, attributes
nobody here reads yet) it hands to that tokenizer, built on first use (`hf`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
# named special tokens, in transformers' order (its special_tokens_map and all_special_ids)
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by its names
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load(path: Path) -> Tokenizer | None:
    """This directory's tokenizer as a `Tokenizer`, or None where it needs transformers' own class (another
    tokenizer_class, settings that class applies on top of tokenizer.json, or no tokenizer.json)."""
    config_file, file = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (config_file.is_file() and file.is_file()):
        return None
    config = json.loads(config_file.read_text())
    # (add_bos_token and friends rewrite the post-processor; a template dict has named variants)
    if config.get("tokenizer_class") not in GENERIC or any(k.startswith("add_") for k in config):
        return None
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is not None and (not isinstance(template, str) or _GENERATION_TAG.search(template)):
        return None  # named templates, or {% generation %} blocks (transformers' own Jinja extension)
    if config.get("clean_up_tokenization_spaces") or config.get("extra_special_tokens") or config.get(
            "additional_special_tokens"):
        return None
    return Tokenizer(path, config, template)


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """The parts of transformers' fast tokenizer this engine calls, with the same results."""

    def __init__(self, path: Path, config: dict, chat_template: str | None) -> None:
        from tokenizers import Tokenizer as Backend

        self.path = path
        self.backend_tokenizer = Backend.from_file(str(path / "tokenizer.json"))
        self._template = None
        self.chat_template = chat_template
        self.special_tokens_map = {k: _token(config[k]) for k in SPECIAL if _token(config.get(k)) is not None}
        for name, token in self.special_tokens_map.items():
            setattr(self, name, token)
        self.bos_token_id = self.convert_tokens_to_ids(self.special_tokens_map.get("bos_token"))
        self.eos_token_id = self.convert_tokens_to_ids(self.special_tokens_map.get("eos_token"))
        self.pad_token_id = self.convert_tokens_to_ids(self.special_tokens_map.get("pad_token"))
        self.all_special_tokens = list(dict.fromkeys(self.special_tokens_map.values()))
        self.all_special_ids = [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]
        self._hf = None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        self._chat_template, self._template = value, None  # compiled again on next use

    @property
    def hf(self):
        """transformers' tokenizer of the same directory (imported and built on first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(str(self.path))
        return self._hf

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if tokens is None:
            return None
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs):
        """The chat rendered by the tokenizer's template as transformers renders it (its Jinja settings and
        helpers, None-valued keys dropped, reasoning under all its names, a final message left open), then
        its ids (tokenize=True; no special tokens added around them) or its text."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        chat = [_with_reasoning({k: _plain(v) for k, v in m.items() if v is not None}) for m in conversation]
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if final is None:
                raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
            if "content" not in self.chat_template:
                raise ValueError('continue_final_message is set to "content" but this is not an accepted field in '
                                 'the chat_template')
            if isinstance(final, (list, tuple)):
                for block in reversed(final):
                    if "text" in block:
                        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise ValueError("continue_final_message is set but the final message has no text to continue")
            else:
                chat[-1]["content"] = final + _CONTINUE_TAG
        values = {**self.special_tokens_map, **{k: _plain(v) for k, v in kwargs.items()}}
        text = self._compiled().render(messages=chat, tools=_plain(tools), documents=None,
                                       add_generation_prompt=add_generation_prompt, **values)
        if final is not None:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message is set but the chat template drops part of the final "
                                 "message")
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled(self):
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        return self._template


def _plain(value):
    """A copy of JSON-like data (the template may not touch the caller's objects)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _with_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _environment():
    """Jinja as transformers sets it up for chat templates: sandboxed, trimmed blocks, loop controls, its
    tojson (no HTML escaping), raise_exception, strftime_now, and dict / namespace without dunder access."""
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env

