"""The OpenAI Agents SDK (`openai-agents`, unmodified) running a tool loop on custody:
`OpenAIChatCompletionsModel` over the chat completions API, tracing off (no network),
two function tools, `tool_choice` required with `reset_tool_choice=False`, and a
`tool_use_behavior` that ends the run after the third round of calls.

The model is random, so the calls are what the tool-call grammar (the tools' own
schemas, in the NemotronH MoE's XML form) lets it write: each must reach its tool with
arguments valid against the tool's schema, as the SDK sends it. The loop runs greedy:
stateless, bound to a session by the `X-Session-ID` header (the SDK cannot send
`session_id`), streamed (`Runner.run_streamed`, whose calls the SDK assembles from
deltas), and with the template's thinking on, where each round reasons first (the
server's default budget: half of `max_tokens`) and its call must still come back as a
tool call. Every run of one thinking setting must make the same calls (a session turn
equals the stateless request, a stream the plain reply), and the session's rounds
reuse its state (`cached_tokens`). What this cannot see: whether a real model would
choose these tools (a random one cannot), and the SDK's handling of text replies
(every round here is calls).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import jsonschema
import openai
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunContextWrapper,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_tracing_disabled,
)
from pydantic import Field

from custody.up import Stack

ROUNDS = 3


Usage = list[tuple[int, int]]  # per round: prompt tokens, cached tokens


def run_agent(
    stack: Stack, headers: dict[str, str], thinking: bool = False, streamed: bool = False
) -> tuple[list[tuple[str, dict]], Usage]:
    """One run of the loop: the calls the tools received, in order, and each round's
    prompt and `cached_tokens`."""
    calls: list[tuple[str, dict]] = []

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two small numbers."""
        calls.append(("add", {"a": a, "b": b}))
        return a + b

    @function_tool
    def lookup(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(("lookup", {"city": city}))
        return "sonnig"

    rounds = 0

    def after_tools(_: RunContextWrapper[Any], results: list) -> ToolsToFinalOutputResult:
        nonlocal rounds
        rounds += 1
        return ToolsToFinalOutputResult(rounds >= ROUNDS, "done" if rounds >= ROUNDS else None)

    async def run() -> Usage:
        url = f"http://127.0.0.1:{stack.settings.port}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", default_headers=headers) as c:
            agent = Agent(
                name="custody",
                instructions="Use the tools.",
                tools=[add, lookup],
                model=OpenAIChatCompletionsModel(model="m", openai_client=c),
                model_settings=ModelSettings(
                    tool_choice="required",
                    parallel_tool_calls=False,
                    temperature=0.0,
                    # thinking: half of it reasons (the default budget), half calls
                    max_tokens=400 if thinking else 200,
                    extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
                ),
                reset_tool_choice=False,
                tool_use_behavior=after_tools,
            )
            question = "Wie ist das Wetter in Köln?"
            if streamed:
                result = Runner.run_streamed(agent, question, max_turns=ROUNDS + 1)
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(agent, question, max_turns=ROUNDS + 1)
        assert result.final_output == "done"
        return [
            (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens)
            for r in result.raw_responses
        ]

    set_tracing_disabled(True)
    cached = asyncio.run(run())
    for name, args in calls:
        tool = {"add": add, "lookup": lookup}[name]
        jsonschema.validate(args, tool.params_json_schema)
    return calls, cached


def test_the_agents_sdk_runs_three_tool_rounds_stateless_and_on_a_session(agent_stack: Stack):
    stateless, cached_stateless = run_agent(agent_stack, {})
    on_session, cached_session = run_agent(agent_stack, {"X-Session-ID": "agent-loop-1"})
    print(
        "cached_tokens per round: stateless",
        cached_stateless,
        "session",
        cached_session,
        "calls",
        json.dumps(on_session),
    )
    assert len(stateless) == ROUNDS and stateless == on_session
    # each round resumes from the state at its start: at least the round before's prompt
    # is reused (a reply the template renders otherwise is what is prefilled again)
    prompts = [p for p, _ in cached_session]
    assert all(c >= p for (_, c), p in zip(cached_session[1:], prompts, strict=False))


def test_the_agents_sdk_loop_streams_and_thinks(agent_stack: Stack):
    """Thinking on, each round's call comes back as a call after its reasoning, plain
    and streamed; streamed, the calls are the plain run's (thinking off and on)."""
    for thinking in (False, True):
        plain, _ = run_agent(agent_stack, {}, thinking=thinking)
        streamed, _ = run_agent(agent_stack, {}, thinking=thinking, streamed=True)
        assert len(plain) == ROUNDS and streamed == plain, thinking
