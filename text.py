"""Text in and out of the engine: tokenizer.json through `tokenizers`, chat templates through jinja2 (rendered as
transformers renders them, in a child process bounded in time, memory and output: a template is the checkpoint's
code), and streaming output that never splits a UTF-8 character. This module imports nothing heavy at its top: the
rendering process imports it."""

import json
import os
import subprocess
import sys
import time

# The bounds of a chat template's rendering (render_chats): real templates take milliseconds, megabytes, and add a
# few hundred characters to the prompt. The wall clock grows with the prompts rendered in one process.
RENDER_SECONDS = 10.0
RENDER_SECONDS_PER_PROMPT = 0.01
RENDER_MEMORY = 1 << 30  # the rendering process's address space, plus 8 bytes per character handed to it
RENDER_ADDED_CHARS = 1 << 20  # a rendered prompt holds at most twice the prompt and this many characters more


class Text:
    """A checkpoint directory's tokenizer (tokenizer.json) and chat template (tokenizer_config.json or
    chat_template.jinja); a file that cannot be read is a ValueError naming it."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        from loading import read_json  # here: the rendering process imports this module without torch
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
        self.chat_template, self.template_file = self.config.get("chat_template"), config_file
        if isinstance(self.chat_template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8", errors="strict") as f:
                self.chat_template, self.template_file = f.read(), template_file
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
        return self.render_chats([prompt])[0]

    def render_chats(self, prompts: list) -> list[str]:
        """render_chat of each prompt (or conversation), all in one child process (render_in_child) that the
        template's code cannot hold past RENDER_SECONDS (+ RENDER_SECONDS_PER_PROMPT each) nor past RENDER_MEMORY,
        whose renderings are refused past RENDER_ADDED_CHARS; every failure is a ValueError naming the template's
        file."""
        conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        request = json.dumps(dict(template=self.chat_template, conversations=conversations, bos_token=self.special(
            "bos_token"), eos_token=self.special("eos_token"), added_chars=RENDER_ADDED_CHARS))
        memory = RENDER_MEMORY + 8 * len(request)
        seconds = RENDER_SECONDS + RENDER_SECONDS_PER_PROMPT * len(prompts)
        path = [os.path.dirname(os.path.abspath(__file__))] + sys.path  # this module first, then the caller's
        child = f"import sys; sys.path[:] = {path!r}; import text; text.render_in_child({memory})"
        try:
            done = subprocess.run([sys.executable, "-I", "-c", child], input=request, capture_output=True,
                                  encoding="utf-8", timeout=seconds)
        except subprocess.TimeoutExpired:
            raise ValueError(f"{self.template_file}: the chat template did not finish rendering in {seconds:g} s"
                             ) from None
        try:
            reply = json.loads(done.stdout)
        except json.JSONDecodeError:  # the process died (a signal, a crash in C code): its last words say why
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:200]
            raise ValueError(f"{self.template_file}: the chat template failed to render (its process ended: "
                             f"{last})") from None
        if "error" in reply:
            raise ValueError(f"{self.template_file}: the chat template failed to render ({reply['error']})")
        return reply["texts"]


class TemplateRaised(Exception):
    """A chat template's own raise_exception(message)."""


def render_in_child(memory: int):
    """The rendering process of Text.render_chats: a request (JSON on stdin) in, {"texts": [...]} or {"error":
    why} (JSON on stdout) out. The template runs in jinja2's ImmutableSandboxedEnvironment, as transformers runs
    it (no attribute of Python's internals, no mutation of the values passed in, ranges up to 100,000), under an
    address-space limit of `memory` bytes."""
    request = json.load(sys.stdin)
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ImportError, ValueError, OSError):  # no such limit here: the parent's wall clock still bounds it
        pass
    try:
        reply = {"texts": render_prompts(request)}
    except TemplateRaised as e:
        reply = {"error": f"it raised: {str(e)[:300]}"}
    except MemoryError:
        reply = {"error": f"it took more than {memory >> 20} MiB"}
    except Exception as e:  # whatever the template's code fails with is the template's failure
        reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    json.dump(reply, sys.stdout)


def render_prompts(request: dict) -> list[str]:
    """The request's conversations rendered (render_in_child), each with the assistant header, as transformers
    renders the template: at most twice the conversation's text and request["added_chars"] more."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    given = [sum(len(str(m.get("content") or "")) for m in messages) for messages in request["conversations"]]
    longest = request["added_chars"] + 2 * max(given, default=0)

    class Sandbox(ImmutableSandboxedEnvironment):
        """A sequence repeated past what a rendering may hold fails at once, before it is built."""
        intercepted_binops = frozenset(["*"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                seq, count = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > longest:
                    raise ValueError(f"it repeats a sequence of {len(seq)} {count} times, past the {longest} "
                                     f"characters a rendering may hold")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateRaised(message)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
        json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    template = env.from_string(request["template"])
    texts = []
    for messages, size in zip(request["conversations"], given):
        text = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False,
                               bos_token=request["bos_token"], eos_token=request["eos_token"])
        if len(text) > 2 * size + request["added_chars"]:
            raise ValueError(f"it rendered {len(text)} characters from a prompt of {size} (at most twice the "
                             f"prompt and {request['added_chars']} more)")
        texts.append(text)
    return texts


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
