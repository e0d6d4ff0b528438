"""Chat templates run in worker processes, bounded in time and memory.

A chat template is code a model's author wrote (any model developer registers one), and
the Jinja sandbox bounds what it may reach, not what it may spend: two nested
``range(100000)`` loops kept the gateway's event loop, and with it every other tenant's
requests, busy for minutes; a string doubled in a loop or a macro takes gigabytes, which
the kernel's out-of-memory killer then takes back from whichever process it picks. So
the gateway renders in a few processes of its own (``multiprocessing``'s spawn context,
each under ``RLIMIT_AS``), one request at a time each, from a thread, so its event loop
never waits on a template. A render past ``RENDER_TIMEOUT_S`` has its process killed
and replaced; one past the memory limit ends in MemoryError there. Both are the model's
fault (BrokenChatTemplate), not the request's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from gateway_svc.chat import BrokenChatTemplate, ChatTemplateError, render

# A render longer than this is stopped: a prompt's layout takes milliseconds.
RENDER_TIMEOUT_S = 5.0
# The address space of a render process: far beyond any prompt, far below the machine's.
RENDER_MEMORY_BYTES = 1 << 30
# Renders at once. A few: each is short, and they run beside the event loop.
RENDER_PROCESSES = 2

Outcome = tuple[str, str]  # ("ok", prompt) | ("refused", why) | ("broken", why)


def _serve(conn: Connection, memory_bytes: int) -> None:
    """A render process: render each (template, messages, special tokens) it is sent."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            template, messages, tokens, generation_prompt, variables = conn.recv()
        except (EOFError, OSError):  # the gateway closed its end, or died
            return
        outcome: Outcome
        try:
            outcome = ("ok", render(template, messages, tokens, generation_prompt, variables))
        except ChatTemplateError as exc:
            outcome = ("refused", str(exc))
        except BrokenChatTemplate as exc:
            outcome = ("broken", str(exc))
        except MemoryError:
            outcome = (
                "broken",
                f"the model's chat template needed more than {memory_bytes >> 20} MiB "
                "(a fault of the model's template, not of the request)",
            )
        conn.send(outcome)


class _Process:
    """One render process, started when first needed and replaced when it is killed."""

    def __init__(self, context, memory_bytes: int):
        self._context = context
        self._memory_bytes = memory_bytes
        self._process = None
        self._conn: Connection | None = None

    def call(self, job: tuple, timeout_s: float) -> Outcome:
        """Render ``job`` (blocking: run it in a thread)."""
        if self._process is None or not self._process.is_alive():
            self._start()
        self._conn.send(job)
        if not self._conn.poll(timeout_s):
            self.close()
            return (
                "broken",
                f"the model's chat template took longer than {timeout_s:g} s to render "
                "(a fault of the model's template, not of the request)",
            )
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            return ("broken", "the model's chat template ended its render process")

    def _start(self) -> None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(theirs, self._memory_bytes), name="chat-render", daemon=True
        )
        process.start()
        theirs.close()
        self._process, self._conn = process, ours

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._conn.close()
        self._process = self._conn = None


class RenderPool:
    """``RENDER_PROCESSES`` render processes shared by the chat endpoint's requests."""

    def __init__(
        self,
        processes: int = RENDER_PROCESSES,
        timeout_s: float = RENDER_TIMEOUT_S,
        memory_bytes: int = RENDER_MEMORY_BYTES,
    ):
        context = multiprocessing.get_context("spawn")  # no copy of the gateway's threads
        self.timeout_s = timeout_s
        self._processes = [_Process(context, memory_bytes) for _ in range(processes)]
        self._idle: asyncio.Queue[_Process] | None = None

    async def render(
        self,
        template: str,
        messages: Sequence[Mapping[str, Any]],
        special_tokens: Mapping[str, str],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """``gateway_svc.chat.render`` in a render process: the prompt, or its
        ChatTemplateError or BrokenChatTemplate (a timeout or the memory limit too)."""
        if self._idle is None:  # made on the loop that serves
            self._idle = asyncio.Queue()
            for process in self._processes:
                self._idle.put_nowait(process)
        process = await self._idle.get()
        job = (
            template,
            [dict(m) for m in messages],
            dict(special_tokens),
            add_generation_prompt,
            dict(variables or {}),
        )
        running = asyncio.ensure_future(asyncio.to_thread(process.call, job, self.timeout_s))
        # Back to the pool when its render ends, even if this request is cancelled first.
        running.add_done_callback(lambda _: self._idle.put_nowait(process))
        kind, text = await asyncio.shield(running)
        if kind == "ok":
            return text
        if kind == "refused":
            raise ChatTemplateError(text)
        raise BrokenChatTemplate(text)

    def close(self) -> None:
        for process in self._processes:
            process.close()
