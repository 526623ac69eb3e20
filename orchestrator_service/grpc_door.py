"""The gRPC front door's checks before a handler runs: the API key, read from the call's metadata before the
request message is (a caller without a key never gets its message read or parsed), and the byte budget that
bounds what admitted and waiting requests hold between them.

The Orchestrator and Jobs services and reflection take a key: health answers every caller (probes carry none).
The priority a request asks for is in its message, so the priority-against-key check stays in the handler."""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Sequence

import grpc

from .api_keys import ApiKeys
from .byte_budget import BudgetFull, ByteBudget
from .servicer import REFUSED_KEY

REFLECTION_PREFIX = "/grpc.reflection."
# A request refused for want of budget is told to retry after this long: held requests end within seconds.
BUDGET_RETRY_AFTER_S = 1.0


def _refusing(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers `code` without reading the request: as a request-streaming handler, gRPC leaves
    the message unread (a unary-request handler would have it received and parsed first)."""
    async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)
    return grpc.stream_stream_rpc_method_handler(refuse)


class ClientDoor(grpc.aio.ServerInterceptor):
    """`services`: the full names of the services keys guard; `budgeted`: the methods (full paths) whose requests
    take their size from `budget` while they are held; `on_refused(method, outcome)`: counts a refusal
    (unauthenticated: the key; rejected: the budget)."""

    def __init__(self, services: Sequence[str], keys: ApiKeys, budget: ByteBudget, budgeted: Sequence[str],
                 on_refused: Callable[[str, str], None] = lambda method, outcome: None):
        self.guarded = (*(f"/{s}/" for s in services), REFLECTION_PREFIX)
        self.keys, self.budget, self.budgeted = keys, budget, frozenset(budgeted)
        self.on_refused = on_refused

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(self.guarded) and self.keys.required:
            header = dict(details.invocation_metadata or ()).get("authorization")
            refused = self.keys.refusal(header if isinstance(header, str) else None, 0)  # priority 0: key only
            if refused is not None:
                self.on_refused(method, "unauthenticated")
                return _refusing(REFUSED_KEY[refused[0]], refused[1])
        handler = await continuation(details)
        if method in self.budgeted and handler is not None:
            if handler.unary_stream is not None:
                return self._budgeted_stream(handler, method)
            if handler.unary_unary is not None:
                return self._budgeted_unary(handler, method)
        return handler

    async def _take(self, take: Callable[[int], None], request: Any, context: grpc.aio.ServicerContext,
                    method: str) -> None:
        try:
            take(request.ByteSize())
        except BudgetFull as e:
            self.on_refused(method, "rejected")
            context.set_trailing_metadata((("retry-after", f"{BUDGET_RETRY_AFTER_S}"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after {BUDGET_RETRY_AFTER_S}s")

    def _budgeted_stream(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = handler.unary_stream

        async def held(request: Any, context: grpc.aio.ServicerContext):
            with self.budget.holding() as take:
                await self._take(take, request, context, method)
                if inspect.isasyncgenfunction(inner):
                    async for ev in inner(request, context):
                        yield ev
                else:  # a handler that sends its events with context.write()
                    await inner(request, context)
        return grpc.unary_stream_rpc_method_handler(held, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)

    def _budgeted_unary(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary

        async def held(request: Any, context: grpc.aio.ServicerContext):
            with self.budget.holding() as take:
                await self._take(take, request, context, method)
                return await inner(request, context)
        return grpc.unary_unary_rpc_method_handler(held, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
