"""What a chat template may spend: no constant folded at compile time, operators that
build bounded strings, and renders in processes of the gateway's own, bounded in time and
memory, while the gateway's event loop goes on serving."""

from __future__ import annotations

import asyncio
import itertools
import time
import tracemalloc

import pytest

from gateway_svc.chat import BrokenChatTemplate, ChatTemplateError, render
from gateway_svc.render_pool import RenderPool
from services.models.chat_template import compile_template

MESSAGES = [{"role": "user", "content": "hi"}]
PLAIN = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"


def test_compiling_folds_no_constant():
    """jinja2 computed ("x" * 10**8) * 100 while compiling: 22 GB at registration."""
    tracemalloc.start()
    try:
        compile_template('{{ ("x" * 100000000) * 100 }}{{ messages[0].content }}')
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20


@pytest.mark.parametrize(
    "template",
    ['{{ "x" * 100000000 }}', "{{ [0] * 2000000 }}", "{{ 10 ** 100000 }}"],
)
def test_operators_build_bounded_values(template):
    with pytest.raises(BrokenChatTemplate, match="SecurityError"):
        render(template, MESSAGES, {})
    assert render('{{ "ab" * 3 }}{{ 2 ** 10 }}{{ [1] + [2] }}', [], {}) == "ababab1024[1, 2]"


def test_renders_run_beside_the_event_loop_bounded_in_time_and_memory():
    async def scenario():
        pool = RenderPool(processes=1, timeout_s=2.0, memory_bytes=512 << 20)
        try:
            assert await pool.render(PLAIN, MESSAGES, {}) == render(PLAIN, MESSAGES, {})
            # Minutes of loops: the event loop keeps ticking meanwhile, and the render
            # is stopped at the timeout.
            ticks: list[float] = []

            async def tick():
                while True:
                    await asyncio.sleep(0.05)
                    ticks.append(time.monotonic())

            ticker = asyncio.create_task(tick())
            started = time.monotonic()
            with pytest.raises(BrokenChatTemplate, match="took longer than 2 s"):
                await pool.render(
                    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}",
                    MESSAGES,
                    {},
                )
            ended = time.monotonic()
            ticker.cancel()
            assert ended - started < 10
            # A loop blocked by the render would not tick for as long as it ran (2 s or
            # more); a busy machine delays a tick by a fraction of that.
            times = [started, *ticks, ended]
            longest_gap = max(later - earlier for earlier, later in itertools.pairwise(times))
            assert longest_gap < (ended - started) / 2, (longest_gap, ended - started)
            # A string doubled by a macro until it takes gigabytes: stopped by the limit.
            with pytest.raises(BrokenChatTemplate, match="more than 512 MiB|took longer"):
                await pool.render(
                    "{% macro grow(s, n) %}{% if n %}{{ grow(s ~ s, n - 1) }}{% endif %}"
                    "{% endmacro %}{{ grow('x', 40) }}",
                    MESSAGES,
                    {},
                )
            # The template's own refusal is the request's, and the pool serves on.
            with pytest.raises(ChatTemplateError, match="no thanks"):
                await pool.render("{{ raise_exception('no thanks') }}", MESSAGES, {})
            assert await pool.render(PLAIN, MESSAGES, {}) == "[user]hi"
        finally:
            pool.close()

    asyncio.run(scenario())
