"""gateway.draft_calls: what a request's end tells the draft pool, with the pool up or marked down."""

from __future__ import annotations

import asyncio

from gateway.backends import DraftTree
from gateway.call_deadlines import CallDeadlines
from gateway.dependencies import DependencyState
from gateway.draft_calls import DraftCalls
from specdec.propose_args import ProposeArgs


class Pool:
    """A draft pool that opens every request and records the Releases it gets."""

    def __init__(self) -> None:
        self.released: list[tuple[str, bool]] = []

    async def propose(self, args: ProposeArgs) -> DraftTree:
        return DraftTree((), (), (), (), {}, 0.0)

    async def release_draft(self, request_id: str, is_finished: bool, new_token_ids=()) -> None:  # noqa: ANN001
        self.released.append((request_id, is_finished))


def _calls(pool: Pool, state: DependencyState) -> DraftCalls:
    return DraftCalls("r1", [1, 2, 3], [], pool, state, CallDeadlines(), lambda: None)  # type: ignore[arg-type]


def test_a_request_ending_while_the_pool_is_marked_down_still_releases_it():
    """One slow call marks the pool down for every request; a request that had proposed and ends then
    still sends its Release (in the background, its end not waiting for it): before, it sent none and
    the pool held the request until its --request_ttl_s (15 minutes)."""
    pool, state = Pool(), DependencyState("draft", retry_s=60.0)

    async def main() -> None:
        calls = _calls(pool, state)
        await calls.propose((("prompt_lookup", 0),), 4, 4, response_format=None, continuation_length=0)
        assert calls.is_open
        state.failed("another request's Propose timed out")
        await calls.release("length")
        for _ in range(100):  # the background Release's turn
            if pool.released:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert pool.released == [("r1", True)]


def test_a_request_that_never_proposed_sends_no_release_while_the_pool_is_down():
    pool, state = Pool(), DependencyState("draft", retry_s=60.0)
    state.failed("down")

    async def main() -> None:
        await _calls(pool, state).release("length")
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert pool.released == []
