"""Stage replicas that MODEL a known service time, for benchmarking the orchestrator alone.

Declared on purpose: each replica serves the real StageService protocol, batches up to `batch`
queued requests, and holds each batch for `service_time` seconds (asyncio.sleep stands in for the
model) before answering with `out_chunks` chunks. Its capacity is therefore exactly
batch / service_time requests per second, which is what the orchestrator benchmark compares against.

Several orchestrators may call the same replicas (each reports its load through GetLoad), as in a cluster
with several orchestrator replicas.

Run: python bench/modeled_stage.py SPEC_JSON  ->  prints {"stage": [ports...]} once serving.
SPEC_JSON: {"stage": {"replicas": r, "batch": b, "service_time": t, "out_chunks": k, "max_queued": q}, ...}
"""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2


class ModeledStage(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, name: str, batch: int, service_time: float, out_chunks: int = 1, max_queued: int = 0):
        self.name, self.batch, self.service_time, self.out_chunks = name, batch, service_time, out_chunks
        self.max_queued = max_queued or 2 * batch
        # Every request gets the same answer, built once: the stages' own CPU per chunk (on a machine whose
        # cores they share with the orchestrators being measured) is then gRPC's alone.
        ref = tensor_pb2.Tensor(name="x", dtype=tensor_pb2.FLOAT32, shape=[1024, 64],
                                ref=tensor_pb2.TensorRef(backend="ucx", address="127.0.0.1:1", key="k", nbytes=1 << 18))
        self.outputs = [stage_pb2.StageOutput(chunk=stage_pb2.Chunk(stage=name, chunk_id=k, tensors=[ref],
                                                                    end_of_stream=k == out_chunks - 1))
                        for k in range(out_chunks)]
        self.jobs: asyncio.Queue = asyncio.Queue()
        self.running = 0
        self.worker = asyncio.get_event_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            group = [await self.jobs.get()]
            while len(group) < self.batch and not self.jobs.empty():
                group.append(self.jobs.get_nowait())
            self.running = len(group)
            await asyncio.sleep(self.service_time)  # the modeled service time of one batch
            self.running = 0
            for done in group:
                done.set()

    async def Process(self, request_iterator, context):
        async for _ in request_iterator:  # header, then every input chunk until the half-close
            pass
        done = asyncio.Event()
        await self.jobs.put(done)
        await done.wait()
        for out in self.outputs:
            yield out

    async def GetLoad(self, request, context):
        return stage_pb2.StageLoad(stage=self.name, running=self.running, queued=self.jobs.qsize(),
                                   max_running=self.batch, max_queued=self.max_queued)


async def serve(spec: dict) -> None:
    ports: dict[str, list[int]] = {}
    servers = []
    for name, s in spec.items():
        for _ in range(s["replicas"]):
            server = grpc.aio.server()
            stage_pb2_grpc.add_StageServiceServicer_to_server(
                ModeledStage(name, s["batch"], s["service_time"], s.get("out_chunks", 1), s.get("max_queued", 0)),
                server)
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            ports.setdefault(name, []).append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            servers.append(server)
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
