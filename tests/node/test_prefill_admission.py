"""Prefill jobs are admitted by prompt tokens, in arrival order, before they lease KV on D."""

from __future__ import annotations

import asyncio

import pytest

from prefill_node.admission import TokenAdmission


async def test_jobs_wait_in_order_until_their_tokens_fit():
    admission = TokenAdmission(100)
    order: list[str] = []

    async def job(name: str, tokens: int, hold: asyncio.Event) -> None:
        held = await admission.acquire(tokens)
        order.append(name)
        await hold.wait()
        admission.release(held)

    holds = {name: asyncio.Event() for name in "abcd"}
    tasks = [asyncio.create_task(job("a", 60, holds["a"])), asyncio.create_task(job("b", 30, holds["b"]))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(job("c", 50, holds["c"])), asyncio.create_task(job("d", 5, holds["d"]))]
    await asyncio.sleep(0)
    assert order == ["a", "b"] and admission.admitted_tokens == 90
    assert admission.waiting == 2  # d (5 tokens) would fit but does not pass c: first come, first served
    holds["a"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "b", "c", "d"] and admission.admitted_tokens == 85
    for hold in holds.values():
        hold.set()
    await asyncio.gather(*tasks)
    assert admission.admitted_tokens == 0 and admission.waiting == 0


async def test_a_job_larger_than_the_budget_enters_alone():
    admission = TokenAdmission(100)
    held = await admission.acquire(5000)
    assert held == 100
    waiter = asyncio.create_task(admission.acquire(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    admission.release(held)
    assert await waiter == 1


async def test_a_job_that_gives_up_while_waiting_holds_nothing():
    admission = TokenAdmission(10)
    held = await admission.acquire(10)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(admission.acquire(5), 0.05)
    assert admission.waiting == 0
    admission.release(held)
    assert admission.admitted_tokens == 0
    assert await admission.acquire(10) == 10


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        TokenAdmission(0)
