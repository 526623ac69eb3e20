"""A server process's main runs its coroutine on uvloop (installed with vLLM), as vLLM's own server does: the
request path pays the loop's per-callback cost per event in every process."""

from __future__ import annotations

import argparse
import asyncio

import uvloop

from omnistage import serving


def test_a_server_process_runs_on_uvloop():
    seen = []

    async def serve(args: argparse.Namespace) -> int:
        seen.append(type(asyncio.get_running_loop()))
        await asyncio.sleep(0)
        return 3

    args = argparse.Namespace(log_level="WARNING", log_format="text", access_log="on", pipeline="p.yaml")
    assert serving.run_server(serve, args, "test") == 3
    assert seen == [uvloop.Loop]


def test_the_loop_runs_grpc_aio():
    """grpc.aio on the loop run_server gives: a unary call through a real server on 127.0.0.1."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def main() -> tuple[type, int]:
        server = grpc.aio.server()
        health = serving.add_health_and_reflection(server, [])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
            return type(asyncio.get_running_loop()), reply.status
        finally:
            await server.stop(None)

    loop, status = serving.run_loop(main())
    assert (loop, status) == (uvloop.Loop, health_pb2.HealthCheckResponse.SERVING)
