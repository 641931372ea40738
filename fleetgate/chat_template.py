"""A model's chat template, rendered the way vLLM renders it before tokenizing a chat.

vLLM (like transformers' `apply_chat_template`) compiles the template in a sandboxed Jinja
environment with `trim_blocks` and `lstrip_blocks`, a `tojson` filter that keeps non-ASCII,
`raise_exception` and `strftime_now` globals and the `{% generation %}` tag, then renders
it with the messages, `add_generation_prompt`, `continue_final_message` and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...). It tokenizes the result without adding
special tokens again. A template that loops over a message's content parts gets them as
parts ("openai" content format); any other gets each message's text parts joined by newlines
("string" format), as vLLM detects.

The gateway renders a chat with the template its workers' tokenizer folder holds to know the
prompt's token ids, and so the blocks an engine caches (fleetgate/kv_index.py); the
simulator renders with it too, so that its caches hold what a vLLM's would. Nothing here
imports anything above the kernel.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["ChatTemplate", "load_chat_template", "read_template"]

# A template that iterates over a message's content: vLLM's "openai" content format.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content)")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_template(folder: Path) -> str:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: the "default" one); "" if none."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return ""
    value = json.loads(config.read_text()).get("chat_template") or ""
    if isinstance(value, list):
        value = next((t.get("template", "") for t in value if t.get("name") == "default"), "")
    return value if isinstance(value, str) else ""


def _special_tokens(folder: Path) -> dict[str, str]:
    """The special tokens a template may name, from tokenizer_config.json (a string or an
    AddedToken's `{"content": ...}`)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return {}
    data = json.loads(config.read_text())
    tokens: dict[str, str] = {}
    for name in _SPECIAL:
        value = data.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            # `{% generation %}...{% endgeneration %}` marks the assistant's tokens for
            # training masks; rendering keeps its body as it is.
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                call = self.call_method("_body")
                return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _body(self, caller: Any) -> Any:
                return caller()

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = dict(special_tokens or {})
        self.content_parts = bool(_ITERATES_CONTENT.search(source))

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:  # fmt: skip
        """The prompt text vLLM would build from these OpenAI-style messages (role, content as
        a string or a list of `{"type": "text", "text": ...}` parts)."""
        shaped = [self._message(m) for m in messages]
        text = self.template.render(
            messages=shaped, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=None, documents=None,
            **self.special_tokens,
        )  # fmt: skip
        if continue_final_message and shaped:
            # As transformers does: cut the render after the final message's content, so
            # that the model goes on with it (whatever the template closes it with).
            final = shaped[-1].get("content")
            if isinstance(final, list):
                final = "".join(str(p.get("text", "")) for p in final if isinstance(p, Mapping))
            if isinstance(final, str) and final.strip() and (at := text.rfind(final.strip())) >= 0:
                text = text[: at + len(final.strip())]
        return text

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        shaped = dict(message)
        if isinstance(content, list):
            texts = [str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type", "text") == "text"]
            shaped["content"] = [{"type": "text", "text": t} for t in texts] if self.content_parts else "\n".join(texts)
        elif self.content_parts:  # vLLM hands such a template its text as one part
            shaped["content"] = [{"type": "text", "text": content}] if content else []
        elif content is None:
            shaped["content"] = ""
        return shaped


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of a model folder (beside its tokenizer.json), or None without one."""
    folder = Path(folder)
    source = read_template(folder)
    return ChatTemplate(source, _special_tokens(folder)) if source else None
