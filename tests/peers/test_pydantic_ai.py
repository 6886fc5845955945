"""pydantic-ai (`pydantic-ai-slim[openai]`, unmodified) asking custody for structured
output through its OpenAI chat model: `ToolOutput` (the output is a call of an output
tool, which pydantic-ai forces with `tool_choice` required) and `NativeOutput` (the
output is JSON content under `response_format` json_schema), with the template's
thinking off and on. pydantic-ai validates the output against its pydantic model and,
with `retries=0`, fails the run at the first reply it cannot use: a call that came back
inside the reasoning (no `tool_calls`), or JSON that does not validate.

The model is random: what it writes is what the grammar allows, so this checks that the
constraint reaches the reply where pydantic-ai reads it, after the reasoning when
thinking is on, and that the schemas pydantic-ai sends compile. It cannot see whether a
real model would fill the fields sensibly.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput, ToolOutput
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from custody.up import Stack


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)
    sunny: bool


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
@pytest.mark.parametrize("output", [ToolOutput, NativeOutput])
def test_pydantic_ai_structured_output_validates(agent_stack: Stack, output, thinking):
    provider = OpenAIProvider(
        base_url=f"http://127.0.0.1:{agent_stack.settings.port}/v1", api_key="none"
    )
    settings = ModelSettings(
        temperature=0.0,
        max_tokens=400 if thinking else 200,  # thinking: half reasons (the default budget)
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )
    agent = Agent(
        OpenAIChatModel("m", provider=provider),
        output_type=output(Weather),
        model_settings=settings,
        retries=0,
    )
    result = agent.run_sync("Wie wird das Wetter in Köln?")
    assert isinstance(result.output, Weather)
    replies = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    called = any(isinstance(p, ToolCallPart) for m in replies for p in m.parts)
    assert called == (output is ToolOutput)
