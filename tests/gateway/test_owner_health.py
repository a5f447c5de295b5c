"""The owner probe's gRPC check against a real asyncio server on port 0: the instance named in its
health service answers; another instance at the same address, or a stopped server, does not."""

from __future__ import annotations

import asyncio

from gateway.owner_health import health_check
from gateway.owner_id import OwnerId
from specdec.service.aio import create_aio_server


def test_the_check_finds_the_instance_itself_and_nothing_else() -> None:
    async def main() -> None:
        instance = OwnerId("127.0.0.1:1", "live0001")
        server, port = await create_aio_server("127.0.0.1:0", [], health_names=[instance.instance_health_name])
        await server.start()
        address = f"127.0.0.1:{port}"
        check = health_check(None, timeout_s=1.0)
        try:
            assert await check(OwnerId(address, instance.nonce))
            assert not await check(OwnerId(address, "gone0002"))  # NOT_FOUND: another process holds the port
        finally:
            await server.stop(None)
        assert not await check(OwnerId(address, instance.nonce))  # nothing listens any more

    asyncio.run(main())
