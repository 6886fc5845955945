"""A conversation as prompt tokens: the messages as the template sees them, rendered,
then tokenized without adding special tokens (the template emits its own BOS).

Special-token strings inside messages (say `<|im_end|>` typed by a user) are text, not
control tokens: transformers' default turns them into special tokens, which lets a
message forge the template's markers. So when a message string holds one, custody
wraps that whole string in private-use markers before rendering, and encodes each marked
span on its own with special tokens off; the template's own text around it is encoded
normally. Without such strings the render is encoded in one piece, exactly as
transformers' `apply_chat_template(..., tokenize=True)` encodes it. See docs/chat.md.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from services.scheduler.text.chat_template import ChatRefused, ChatTemplate

START, END = "\ue000", "\ue001"  # private-use markers around a message string
MARKED = re.compile(f"{START}(.*?){END}", re.DOTALL)


class ChatTokenizer(Protocol):
    special_tokens: tuple[str, ...]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def encode_plain(self, text: str) -> list[int]: ...


def template_message(message: dict, takes_lists: bool) -> dict:
    """`message` (JSON, nulls dropped) as the template sees it: list content passes
    through when the template loops over content, else its text parts are joined by
    newlines (what a template written for strings can render). A tool call's
    `arguments`, a JSON object's text on the wire, reach the template as the object (as
    vLLM gives them: NemotronH's template walks them with `|items`)."""
    content = message.get("content")
    if isinstance(content, list) and not takes_lists:
        message = message | {"content": "\n".join(part["text"] for part in content)}
    if message.get("tool_calls"):
        message = message | {"tool_calls": [_decoded(call) for call in message["tool_calls"]]}
    return message


def _decoded(call: Any) -> Any:
    """A tool call with its arguments as an object, when they are one's JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(decoded, dict):
        return call
    return call | {"function": function | {"arguments": decoded}}


def _mark(value: Any, specials: re.Pattern) -> Any:
    """Every string of `value` that holds a special-token string, dict keys included (a
    tool's parameter names are rendered too), wrapped in markers (`tokens` refuses
    strings that hold markers, so none can be forged). A key the template looks up by
    name never holds one, so marking leaves every lookup as it was."""
    if isinstance(value, str):
        return START + value + END if specials.search(value) else value
    if isinstance(value, dict):
        return {
            _mark(k, specials): v if k == "role" else _mark(v, specials) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_mark(v, specials) for v in value]
    return value


class ChatEncoder:
    """A template and the tokenizer its prompts are encoded with."""

    def __init__(self, template: ChatTemplate, tokenizer: ChatTokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        names = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, names))) if names else None

    def messages(self, raw: list[dict]) -> list[dict]:
        return [template_message(m, self.template.takes_lists) for m in raw]

    def tokens(
        self, messages: list[dict], add_generation_prompt: bool, variables: dict | None = None
    ) -> list[int]:
        """The rendered conversation's tokens (`messages` as `messages()` gives them;
        `variables`: the template's others, `tools` among them)."""
        strings = _strings([messages, variables])
        marked = self._specials is not None and any(self._specials.search(s) for s in strings)
        if not marked:
            text = self.template.render(messages, add_generation_prompt, variables)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if any(START in s or END in s for s in strings):
            raise ChatRefused(
                "a message holds a special-token string, and one holds U+E000 or U+E001, "
                "the private-use characters custody marks such strings with; remove either"
            )
        specials = self._specials
        text = self.template.render(
            _mark(messages, specials), add_generation_prompt, _mark(variables, specials)
        )
        return self._encode_marked(text)

    def _encode_marked(self, text: str) -> list[int]:
        pieces = MARKED.split(text)  # [template text, marked string, template text, ...]
        if any(START in p or END in p for p in pieces):
            raise ChatRefused(
                "the chat template cuts into a message string that holds a special-token "
                "string, so it cannot be kept as plain text; remove the special token"
            )
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self.tokenizer.encode_plain(piece)
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        keys = [k for k in value if isinstance(k, str)]
        return keys + [s for k, v in value.items() if k != "role" for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
