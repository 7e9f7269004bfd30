"""OpenAI's Agents SDK (``openai-agents``) runs an agent with a function tool against
tserve's ``/v1/responses``, through ``OpenAIResponsesModel`` and an ``AsyncOpenAI``
client of its own. The tiny model writes noise, so the first turn is forced to call
the tool once (``tool_choice="required"``, no parallel calls; the SDK resets the
choice after the call) and the answer is a structured output: both are grammars, so
the run must complete."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.web.conftest import API_KEY, Server

pytestmark = pytest.mark.slow


class Report(BaseModel):
    summary: str = Field(max_length=20)


def agent_client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def weather_agent(client: AsyncOpenAI, calls: list[str]) -> Agent[None]:
    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"21 C in {city}"

    set_tracing_disabled(True)  # no traces leave the machine
    return Agent(
        name="weather",
        instructions="Answer with the tool's weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False),
        output_type=Report,
    )


def test_an_agent_run_calls_its_tool_and_completes(server: Server) -> None:
    calls: list[str] = []
    client = agent_client(server)
    try:
        result = Runner.run_sync(weather_agent(client, calls), "Weather in Paris?", max_turns=4)
    finally:
        # run_sync leaves the thread's default loop open, and the client's connections
        # belong to it: they close there, not in whichever later test's loop collects
        # the client (the SDK's finalizer would schedule aclose on a foreign loop)
        asyncio.get_event_loop_policy().get_event_loop().run_until_complete(client.close())
    assert len(calls) >= 1 and set(calls) <= {"Paris", "Oslo"}
    assert isinstance(result.final_output, Report)
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds
    assert kinds[-1] == "message_output_item"


def test_a_streamed_agent_run_completes(server: Server) -> None:
    calls: list[str] = []

    async def run() -> tuple[list[str], object]:  # the SDK runs on asyncio
        async with agent_client(server) as client:
            result = Runner.run_streamed(
                weather_agent(client, calls), "Weather in Oslo?", max_turns=4
            )
            kinds: list[str] = [event.type async for event in result.stream_events()]
            return kinds, result.final_output

    kinds, final = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(calls) >= 1 and isinstance(final, Report)
