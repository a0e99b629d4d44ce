"""A private event loop that plays an env's own async episode, a model call at a time.

The verifiers adapters (:mod:`~agile_llmenvs.adapters.verifiers` for the classic API,
:mod:`~agile_llmenvs.adapters.verifiers_v1` for verifiers 0.4) run the env's rollout
coroutine with a model client that parks each call until the policy answers. This module is
the part they share: the loop (run in the calling thread, with its own worker threads for
the env's sync work), the episode's task, running it until the env asks the model or ends,
each wait bounded by ``call_timeout_s``, and cancelling it; and how the env's messages
become the observation text and ``info["messages"]``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Conversation",
    "EpisodeLoop",
    "message_dict",
    "message_text",
    "observation_text",
    "pick_index",
]


class EpisodeLoop:
    """One env's event loop and the episode under way on it.

    Args:
        call_timeout_s: The longest the env may work between two model calls (and any other
            wait :meth:`run` bounds); None waits for ever.
        thread_name: The prefix of the loop's worker threads (joined on :meth:`close`).
    """

    def __init__(self, call_timeout_s: float | None, thread_name: str) -> None:
        self.call_timeout_s = call_timeout_s
        self.loop = asyncio.new_event_loop()
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix=thread_name)
        self.loop.set_default_executor(self._executor)
        self.task: asyncio.Task[Any] | None = None

    def start(self, episode: Coroutine[Any, Any, Any]) -> None:
        """Schedule ``episode`` (it runs as :meth:`advance` drives the loop)."""
        self.task = self.loop.create_task(episode)

    def advance(self, asked: asyncio.Future[Any]) -> Any | None:
        """Run the loop until ``asked`` resolves (the env's next model call: its result is
        returned) or the episode ends (None).

        Raises:
            TimeoutError: neither within ``call_timeout_s``; the caller cancels the episode.
        """
        assert self.task is not None
        episode = self.task

        async def next_call() -> Any | None:
            done, _ = await asyncio.wait(
                {episode, asked}, timeout=self.call_timeout_s, return_when="FIRST_COMPLETED"
            )
            if asked in done:
                return asked.result()
            if episode in done:
                return None
            raise TimeoutError(
                f"the verifiers env did not reply within call_timeout_s={self.call_timeout_s}"
            )

        return self.loop.run_until_complete(next_call())

    def finish(self) -> Any:
        """The ended episode's result (its exception raised), and no episode under way."""
        assert self.task is not None
        episode, self.task = self.task, None
        return episode.result()

    def run(self, awaitable: Any, doing: str) -> Any:
        """Run ``awaitable`` on the loop, bounded by ``call_timeout_s``.

        Raises:
            TimeoutError: it took longer, naming what it was ``doing``.
        """
        try:
            return self.loop.run_until_complete(
                asyncio.wait_for(awaitable, timeout=self.call_timeout_s)
            )
        except TimeoutError as exc:
            raise TimeoutError(
                f"{doing} took longer than call_timeout_s={self.call_timeout_s}"
            ) from exc

    def cancel(self) -> None:
        """Cancel the episode under way (its cleanup handlers run, for up to
        ``call_timeout_s``)."""
        episode, self.task = self.task, None
        if episode is None or episode.done():
            return
        episode.cancel()
        self.loop.run_until_complete(asyncio.wait({episode}, timeout=self.call_timeout_s))

    def wait_all(self, *, cancel: bool) -> None:
        """Wait for the loop's other tasks, for up to ``call_timeout_s``; with ``cancel``,
        cancel them first."""
        leftover = asyncio.all_tasks(self.loop)
        if cancel:
            for task in leftover:
                task.cancel()
        if leftover:
            self.loop.run_until_complete(asyncio.wait(leftover, timeout=self.call_timeout_s))

    def close(self) -> None:
        """Finish the loop's async generators, join its worker threads and close it (the
        episode and every task already ended: :meth:`cancel`, :meth:`wait_all`)."""
        try:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self.loop.close()


@dataclass
class Conversation:
    """What the policy has seen of the episode under way: its row (task) index and the
    messages of the env's last model call."""

    index: int
    shown: list[Any] = field(default_factory=list)

    def first(self, messages: Sequence[Any]) -> tuple[str, dict[str, Any]]:
        """The reset's observation of the env's first model call: its text, and ``info``
        with the index, the messages and the system messages' text as ``system_prompt``."""
        self.shown = list(messages)
        system = [message_text(m.content) for m in messages if m.role == "system"]
        info: dict[str, Any] = {
            "row_index": self.index,
            "messages": [message_dict(m) for m in messages],
        }
        if system:
            info["system_prompt"] = "\n\n".join(system)
        return observation_text(messages), info

    def next(self, messages: Sequence[Any]) -> tuple[str, dict[str, Any]]:
        """A step's observation of the env's next model call: the messages after the
        policy's own (tool results, the user's turn)."""
        new = list(messages[len(self.shown) + 1 :])
        self.shown = list(messages)
        return observation_text(new), {
            "row_index": self.index,
            "messages": [message_dict(m) for m in new],
        }


def pick_index(size: int, seed: int | None, row_index: int | None, noun: str) -> int:
    """``row_index`` (checked against ``size``), else an index drawn by ``seed``, else 0.

    Raises:
        IndexError: ``row_index`` is outside the ``size`` items (``noun``: rows, tasks).
    """
    if row_index is None:
        return random.Random(seed).randrange(size) if seed is not None else 0
    index = int(row_index)
    if not 0 <= index < size:
        raise IndexError(f"row_index {index} is outside the {size} {noun}")
    return index


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        data = part if isinstance(part, Mapping) else getattr(part, "__dict__", {})
        if data.get("type") == "text":
            parts.append(str(data.get("text", "")))
    return "\n".join(parts)


def message_dict(message: Any) -> dict[str, Any]:
    """A verifiers message as ``info["messages"]`` holds it: role, text, tool call id."""
    found: dict[str, Any] = {"role": message.role, "content": message_text(message.content)}
    if getattr(message, "tool_call_id", None):
        found["tool_call_id"] = message.tool_call_id
    return found


def observation_text(messages: Sequence[Any]) -> str:
    """The observation of ``messages``: their texts, the system message left out."""
    return "\n\n".join(message_text(m.content) for m in messages if m.role != "system")
