"""A checkpoint's chat template, rendered as transformers renders it.

The template comes from `chat_template.jinja` in the model directory, else from
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates of
which "default" is used); the built-in model has `DEFAULT_TEMPLATE`. Templates are
untrusted code from the Hub, so they run in Jinja's immutable sandbox, with the
environment transformers gives them (trim_blocks, lstrip_blocks, loop controls, a `tojson`
that keeps non-ASCII, `raise_exception`, `strftime_now`) and the special tokens of
`tokenizer_config.json` as variables (`bos_token`, `eos_token`, ...). See docs/chat.md.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_SPECIALS

# The built-in byte-level model's format: each message as `<|role|>\n{content}\n`, then
# `<|assistant|>\n` when a reply is asked for. These markers are plain bytes (its only
# special tokens are `<|bos|>` and `<|eos|>`).
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message.role }}|>\n"
    "{{ message.content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatRefused(ValueError):
    """These messages cannot be a prompt (the template refused them, or there is no
    template): a 400 at the edge, with this message."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False
) -> str:
    """Jinja's own `tojson` escapes HTML characters; chat templates expect plain JSON."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """The checkpoint's template source (None: it has none) and its special tokens by
    name (`bos_token`...), which the template sees as variables."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    tokens = {
        name: text
        for name, value in config.items()
        if name.endswith("_token") and (text := _token_text(value)) is not None
    }
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(), tokens
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return (source if isinstance(source, str) else None), tokens


def iterates_content(source: str) -> bool:
    """The template loops over a message's content (`for part in m.content` or
    `m['content']`): it handles content given as a list of parts."""
    ast = _environment().parse(source)
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and getattr(it.arg, "value", None) == "content":
            return True
    return False


class ChatTemplate:
    """One compiled template and the variables it is rendered with."""

    def __init__(self, source: str | None, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template = None if source is None else _environment().from_string(source)
        self.takes_lists = source is not None and iterates_content(source)

    @classmethod
    def load(cls, model_dir: Path | None) -> ChatTemplate:
        if model_dir is None:
            names = {i: text for text, i in BYTE_SPECIALS.items()}
            return cls(
                DEFAULT_TEMPLATE, {"bos_token": names[BYTE_BOS], "eos_token": names[BYTE_EOS]}
            )
        return cls(*read_template(Path(model_dir)))

    def render(
        self, messages: list[dict], add_generation_prompt: bool, variables: dict | None = None
    ) -> str:
        """The conversation as text; `variables`: the request's `tools` and template
        kwargs. A template that fails (its own `raise_exception` among them) refuses
        the request with the template's message."""
        if self._template is None:
            raise ChatRefused(
                "this checkpoint has no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template); use /v1/completions"
            )
        try:
            given = {"tools": None, "documents": None} | (variables or {})
            return self._template.render(
                self.special_tokens
                | given
                | {"messages": messages, "add_generation_prompt": add_generation_prompt}
            )
        except jinja2.exceptions.TemplateError as err:
            raise ChatRefused(f"the chat template refused these messages: {err}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise ChatRefused(f"the chat template failed on these messages: {err}") from None
