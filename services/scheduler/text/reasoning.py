"""A reply's reasoning apart from its answer (`--reasoning-parser`, vLLM's and SGLang's
names), for models that think between `<think>` and `</think>`:

- `deepseek_r1`: the prompt may open the block itself, so everything before `</think>`
  is reasoning (an opening `<think>` in the reply is dropped); a reply that never
  closes it is all reasoning (cut off while thinking).
- `qwen3`: reasoning only inside a block the reply itself opens; without one, all answer.
- `nemotron_v3`: as `deepseek_r1` (NemotronH's template ends the prompt with `<think>`),
  except that with thinking switched off (`chat_template_kwargs.enable_thinking`
  false) the reply is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.scheduler.text.tool_calls import partial_marker

ReasoningName = Literal["deepseek_r1", "qwen3", "nemotron_v3"]
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str
    answer: str
    settled: int  # characters of the reply both parts account for (a stream's progress)


class ReasoningParser:
    def __init__(self, name: ReasoningName, thinking: bool) -> None:
        """`thinking`: the template's thinking switch as the request set it."""
        self.opened_by_prompt = name in ("deepseek_r1", "nemotron_v3")
        self.off = name == "nemotron_v3" and not thinking

    def split(self, text: str, final: bool) -> Split:
        """`text` as reasoning and answer; with `final` False, a tail that may be the
        start of a marker is left unsettled."""
        if self.off:
            return Split("", _without_empty_block(text), len(text))
        body = text.lstrip()
        lead = len(text) - len(body)
        opened = body.startswith(OPEN)
        if opened:
            body, lead = body[len(OPEN) :], lead + len(OPEN)
        elif not final and OPEN.startswith(body):
            return Split("", "", 0)  # may still become "<think>"
        if not opened and not self.opened_by_prompt:
            return Split("", text, len(text))
        close = body.find(CLOSE)
        if close < 0:
            keep = len(body) if final else len(body) - partial_marker(body, CLOSE)
            return Split(body[:keep], "", lead + keep)
        return Split(body[:close], body[close + len(CLOSE) :], len(text))


def _without_empty_block(text: str) -> str:
    """A reply with thinking off may still open with `<think></think>`: not answer."""
    stripped = text.lstrip()
    empty = OPEN + CLOSE
    return stripped[len(empty) :].lstrip("\n") if stripped.startswith(empty) else text
