"""Following a stored request: each growth of its output, then its end; each active state read is
offered for adoption."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.follow import follow, is_orphaned
from specdec.errors import NotFound
from specdec.state_store import AsyncInMemoryStateStore, InMemoryStateStore, RequestState, RequestStatus

LEASE_S = 3.0


def test_an_active_unowned_request_is_orphaned_only_once_a_lease_passed_without_a_write():
    store = InMemoryStateStore()
    store.create("r", {}, prompt_token_ids=[1], status=RequestStatus.RUNNING)
    state = store.load("r")
    assert state is not None and state.owner == ""
    assert not is_orphaned(state, LEASE_S, state.updated_ms + 2_999)  # just created: its gateway claims it
    assert is_orphaned(state, LEASE_S, state.updated_ms + 3_000)
    assert not is_orphaned(dataclasses.replace(state, owner="gateway@a:1"), LEASE_S, state.updated_ms + 10_000)
    ended = dataclasses.replace(state, status=RequestStatus.FINISHED)
    assert not is_orphaned(ended, LEASE_S, state.updated_ms + 10_000)


def test_a_follower_sees_each_step_and_the_end_and_offers_each_active_state_for_adoption():
    async def main() -> None:
        store = AsyncInMemoryStateStore(InMemoryStateStore())
        await store.create("r", {}, prompt_token_ids=[1], status=RequestStatus.RUNNING)
        offered: list[tuple[str, bool]] = []

        async def adopt(state: RequestState) -> bool:
            offered.append((state.request_id, state.status.is_terminal))
            return False

        async def run_steps() -> None:
            for n, step in enumerate(([5, 6], [7])):
                await asyncio.sleep(0.02)
                await store.append_step("r", step, expected_num_tokens=2 * n)
            await store.set_status("r", RequestStatus.FINISHED, finish_reason="length")

        writer = asyncio.ensure_future(run_steps())
        seen = [list(s.token_ids) async for s in follow(store, "r", adopt, poll_s=0.005)]
        await writer
        assert seen[0] == [] and seen[-1] == [5, 6, 7] and [5, 6] in seen
        assert seen == sorted(seen, key=len)  # only growth is reported, then the end
        assert offered and set(offered) == {("r", False)}  # every active poll; never the ended request
        with pytest.raises(NotFound):
            async for _ in follow(store, "missing", adopt):
                pass

    asyncio.run(main())
