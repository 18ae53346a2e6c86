"""Text in and out of the engine: tokenizer.json through `tokenizers`, chat templates through jinja2 (rendered as
transformers renders them), and streaming output that never splits a UTF-8 character."""

import json
import os
import time

from loading import read_json


class Text:
    """A checkpoint directory's tokenizer (tokenizer.json) and chat template (tokenizer_config.json or
    chat_template.jinja); a file that cannot be read is a ValueError naming it."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises plain Exceptions for every malformed file
            raise ValueError(f"{file}: not a readable tokenizer ({str(e).splitlines()[0][:200]})") from None
        config_file = os.path.join(path, "tokenizer_config.json")
        self.config = read_json(config_file) if os.path.isfile(config_file) else {}
        template_file = os.path.join(path, "chat_template.jinja")
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8", errors="strict") as f:
                self.chat_template = f.read()
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"{config_file}: chat_template must be a string")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special(self, name: str) -> str:
        value = self.config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def render_chat(self, prompt: str | list[dict]) -> str:
        """The user turn plus the assistant header, as transformers' apply_chat_template(add_generation_prompt=True,
        enable_thinking=False) renders it (DFlash drafters were trained without thinking). A list of messages
        ({"role": "user" or "assistant", "content": ...}, the user's last) renders a whole conversation."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
            json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, enable_thinking=False,
                bos_token=self.special("bos_token"), eos_token=self.special("eos_token"))
        except (TemplateError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"the chat template failed to render ({type(e).__name__}: {e})") from None


class Streamer:
    """Prints text as tokens are committed, holding back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, text: Text, out):
        """out: a text stream, or None to keep the ids only (--json, or stdout closed)."""
        self.text, self.out, self.ids, self.printed = text, out, [], 0

    def __call__(self, new_ids):
        self.ids += new_ids
        if self.out is None:
            return
        s = self.text.decode(self.ids, skip_special_tokens=True)  # e.g. the final <|im_end|>
        if s.endswith("\ufffd"):
            return
        self.out.write(s[self.printed:])
        self.out.flush()
        self.printed = len(s)
