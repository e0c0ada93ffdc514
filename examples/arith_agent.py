"""A worked agent, written only against the `openai` Python client, that areal_jobs trains.

    make run OVERRIDES="rollout/workflow=openai_agent rollout.workflow.agent=examples.arith_agent:agent"

It asks the question, reads the answer, checks its format ("The answer is N.", what the built-in
task's reward reads) and, when the answer is malformed, asks once more. Nothing in it knows about
training: pointed at any OpenAI-compatible server it runs the same
(`asyncio.run(agent("http://host:8000/v1", [{"role": "user", "content": "..."}], model="..."))`). Under
rollout/workflow=openai_agent each call is one model turn of the episode, and the episode's
reward is the task's reward on the last answer (the function returns None). docs/agents.md.
"""

from __future__ import annotations

import re

from openai import AsyncOpenAI

ANSWER = re.compile(r"The answer is (-?\d+)\.")
ASK_AGAIN = "Please finish with one sentence 'The answer is N.', N being your final number."


async def agent(base_url: str, messages: list[dict], model: str = "policy", api_key: str = "unused") -> None:
    # max_retries=0: the endpoint's refusals are deterministic, a retry would only wait
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        history = list(messages)
        reply = await client.chat.completions.create(model=model, messages=history)
        answer = reply.choices[0].message.content or ""
        if ANSWER.search(answer) is None:
            # the history goes back unchanged, the reply exactly as it came, then the new message
            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": ASK_AGAIN}]
            await client.chat.completions.create(model=model, messages=history)
    finally:
        await client.close()
    return None  # the workflow scores the last answer with the prompt's own reward task
