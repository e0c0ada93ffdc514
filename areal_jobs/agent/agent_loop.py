"""The event loop users' agents run on: its own thread, beside the controller's loop.

An agent's own work (building its OpenAI client, which loads the TLS trust store: ~50 ms per
client on a busy CPU; parsing replies; a blocking call written by mistake inside `async def`)
must not stall the controller's loop, which also serves the endpoint, keeps the servers' HTTP
connections alive and runs weight updates. Measured on the 2-core CPU machine: 20 clients built on
the controller's loop stalled it 1.2 s, and a stalled loop reused a keep-alive connection the
server had closed (a weight update's /pause_generation failed and the run ended). Built here,
they delay the controller's loop by 0.07 s at most (the TLS loading releases the GIL).

Async agents run as tasks of this loop, plain functions in its thread pool; their HTTP requests
reach the endpoint on the controller's loop like any client's.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable


class AgentLoop:
    """A daemon thread running one asyncio loop for every agent of this process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="areal-agents", daemon=True)
        self._thread.start()

    async def call(self, agent: Callable, arguments: dict) -> object:
        """`agent(**arguments)` on this loop (a plain function in its thread pool), awaited from
        the caller's loop; cancelling the caller cancels the agent."""
        future = asyncio.run_coroutine_threadsafe(_invoke(agent, arguments), self.loop)
        return await asyncio.wrap_future(future)

    async def stop(self) -> None:
        """Cancel every agent still running and end the thread (tests; the controller's loop
        lives as long as its process)."""
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop))
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join)
        self.loop.close()


async def _invoke(agent: Callable, arguments: dict) -> object:
    if inspect.iscoroutinefunction(agent):
        return await agent(**arguments)
    result = await asyncio.to_thread(functools.partial(agent, **arguments))
    return await result if inspect.isawaitable(result) else result  # an object with async __call__


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_default_executor()
