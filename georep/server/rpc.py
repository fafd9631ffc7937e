"""What every grpc.aio service of a node shares: parsing requests, and ending a call on a domain error.

Handlers receive the request as raw bytes and parse it themselves
(:func:`parse`): a request that is not a valid protobuf gets
``INVALID_ARGUMENT`` with a message, instead of gRPC's generic
deserialization failure, and every repeated field is bounded
(``georep/proto/bounds.py``). A domain error raised by a handler ends the call
with the status code ``georep/server/status.py`` gives it and its own message.

**Authorization** (:class:`Authorization`, a server interceptor) runs before every handler of a node that serves
TLS: it asks ``georep/security/acl_rpc.py``'s table whether the caller's principal may make the call (and, on a
client stream whose rule reads the request, each message), and ends a refused call with ``PERMISSION_DENIED``
and the decision's message. The handlers check nothing themselves. A plaintext node (``--insecure``) has no
interceptor: it authorizes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from cluster.quorum import Fenced
from georep.auth.acl import DEFAULT_SUPER_USERS
from georep.auth.acl_sync import AclCache
from georep.auth.policy import Policy
from georep.auth.principal import Principal
from georep.broker.errors import DamagedData, InvalidRequest, NotLeader
from georep.metadata.store import MetadataStore
from georep.proto.bounds import check_bounds
from georep.proto.reasons import FENCED_EPOCH_METADATA as FENCED_EPOCH_METADATA  # read by server/recovery.py
from georep.proto.reasons import LEADER_METADATA as LEADER_METADATA
from georep.proto.reasons import NEXT_OFFSET_METADATA, REASON_METADATA
from georep.security.acl_rpc import NODE_ACCESS, SEGMENTS_ACCESS, Access, Authorizer
from georep.security.tls import principal_of
from georep.server.status import DOMAIN_ERRORS, reason_of, status_of
from topology.model import Topology

M = TypeVar("M", bound=Message)
# Handlers take raw bytes (no deserializer), or the message the authorization screen already parsed, read it with
# parse(), and return messages.
Context = grpc.aio.ServicerContext[bytes, Message]

Unary = Callable[[bytes, Context], Awaitable[Message]]
Streaming = Callable[[Any, Context], AsyncIterator[Message]]


def parse(cls: type[M], data: bytes | M) -> M:
    """``data`` parsed and bounds-checked; a message the authorization screen already parsed is taken as it is
    (a client stream's batches are parsed once, not once to screen them and again to serve them)."""
    if not isinstance(data, bytes):
        assert isinstance(data, cls), f"{cls.__name__} expected, got {type(data).__name__}"
        return data
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidRequest(
            f"malformed {cls.__name__}: {exc}; use a client built from georep/proto/georep.proto"
        ) from None
    check_bounds(msg)
    return msg


def status(exc: Exception) -> grpc.StatusCode:
    return status_of(exc) or grpc.StatusCode.INTERNAL


def _trailers(exc: Exception) -> tuple[tuple[str, str], ...]:
    """What a caller needs to act on the error besides its code: the reason (what a client program tells the
    errors of one code apart by), and where readable data goes on (a consumer that skips a damaged batch), the
    epoch a member is fenced at (a recovery that learns of a newer leader), or the leader's address."""
    reason = ((REASON_METADATA, str(reason_of(exc))),)
    if isinstance(exc, DamagedData):
        return (*reason, (NEXT_OFFSET_METADATA, str(exc.next_offset)))
    if isinstance(exc, Fenced):
        return (*reason, (FENCED_EPOCH_METADATA, str(exc.fenced_epoch)))
    if isinstance(exc, NotLeader) and exc.leader_hint:
        return (*reason, (LEADER_METADATA, exc.leader_hint))
    return reason


async def abort(context: Context, exc: Exception) -> None:
    """End the call with ``exc``'s status code, its message and its trailers (raises, as ``context.abort`` does)."""
    await context.abort(status(exc), str(exc), _trailers(exc))


def _serialize(msg: Message) -> bytes:
    return msg.SerializeToString()


def unary(fn: Unary) -> grpc.RpcMethodHandler[bytes, Message]:
    async def call(data: bytes, context: Context) -> Message:
        try:
            return await fn(data, context)
        except DOMAIN_ERRORS as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises

    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=None, response_serializer=_serialize)


def _streaming(fn: Streaming) -> Streaming:
    """A streaming handler whose domain errors end the call with their status code."""

    async def call(request: Any, context: Context) -> AsyncIterator[Message]:
        try:
            async for msg in fn(request, context):
                yield msg
        except DOMAIN_ERRORS as exc:
            await abort(context, exc)

    return call


def unary_stream(fn: Streaming) -> grpc.RpcMethodHandler[bytes, Message]:
    return grpc.unary_stream_rpc_method_handler(_streaming(fn), None, _serialize)


def stream_stream(fn: Streaming) -> grpc.RpcMethodHandler[bytes, Message]:
    return grpc.stream_stream_rpc_method_handler(_streaming(fn), None, _serialize)


def service(name: str, methods: Mapping[str, grpc.RpcMethodHandler[bytes, Message]]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(name, dict(methods))


async def merge_streams(sources: list[AsyncIterator[M]], queue_max: int = 4) -> AsyncIterator[M]:
    """The messages of every source as they come; the first source to fail ends it all with its error, and one
    that ends ends it all too (a pull over several nodes is whole or not at all: the caller opens it again)."""
    queue: asyncio.Queue[tuple[int, M | BaseException | None]] = asyncio.Queue(queue_max)

    async def pump(index: int, source: AsyncIterator[M]) -> None:
        try:
            async for message in source:
                await queue.put((index, message))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        while True:
            _index, item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()  # the handler's answers ended
SCREENED_ANSWERS_MAX = 1024  # answers of a screened client stream waiting for the caller to read them


def authorization(
    site: str,
    metadata: MetadataStore,
    topology: Topology | None,
    super_users: Iterable[Principal] = DEFAULT_SUPER_USERS,
) -> Authorization:
    """The interceptor of a TLS node of ``site``: its ACLs from ``metadata``, its links from ``topology``."""
    policy = Policy(site, AclCache(metadata.acls), lambda: topology, super_users)
    tables = {"georep.v1.Node": NODE_ACCESS, "georep.v1.Segments": SEGMENTS_ACCESS}
    return Authorization(Authorizer(policy, principal_of), tables)


class Authorization(grpc.aio.ServerInterceptor):
    """Checks every call against ``tables`` (service name -> its method table) before its handler runs."""

    def __init__(self, authorizer: Authorizer, tables: Mapping[str, Mapping[str, Access]]) -> None:
        self.authorizer = authorizer
        self.tables = tables
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # an unknown method: grpc answers UNIMPLEMENTED
        full = handler_call_details.method
        cached = self._guarded.get(full)
        if cached is not None and cached[0] is handler:  # the services' handlers are made once
            return cached[1]
        service_name, _, method = full.lstrip("/").partition("/")
        guarded = _guarded(handler, self.authorizer, self.tables.get(service_name, {}), method)
        self._guarded[full] = (handler, guarded)
        return guarded


def _guarded(
    handler: grpc.RpcMethodHandler[Any, Any], authorizer: Authorizer, table: Mapping[str, Access], method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with the check first; a client stream's messages checked one by one when the rule reads them."""

    async def admit(data: bytes, context: Context) -> bytes | Message:
        """The request for the handler once it is allowed (parsed if the check parsed it); ends the call otherwise."""
        try:
            principal = authorizer.principal(method, context)
            if not authorizer.unrestricted(principal):
                request = authorizer.check(table, method, principal, data, parse)
                return data if request is None else request
        except DOMAIN_ERRORS as exc:
            await abort(context, exc)
        return data

    if handler.unary_unary is not None:
        inner_uu: Any = handler.unary_unary  # an async handler of rpc.unary (the stubs type them sync)

        async def unary_unary(data: bytes, context: Context) -> Message:
            return await inner_uu(await admit(data, context), context)  # type: ignore[no-any-return]

        return grpc.unary_unary_rpc_method_handler(unary_unary, None, handler.response_serializer)
    if handler.unary_stream is not None:
        inner_us: Any = handler.unary_stream

        async def unary_stream_(data: bytes, context: Context) -> AsyncIterator[Message]:
            async for msg in inner_us(await admit(data, context), context):
                yield msg

        return grpc.unary_stream_rpc_method_handler(unary_stream_, None, handler.response_serializer)
    inner_ss: Any = handler.stream_stream
    assert inner_ss is not None, f"{method}: stream-unary handlers are not used"
    per_message = authorizer.per_message(table, method)

    async def stream_stream_(requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[Message]:
        principal = None
        try:
            principal = authorizer.principal(method, context)
            unrestricted = authorizer.unrestricted(principal)
            if not per_message and not unrestricted:
                authorizer.check(table, method, principal, b"", parse)
        except DOMAIN_ERRORS as exc:
            await abort(context, exc)
        assert principal is not None
        if not per_message or unrestricted:  # a super-user's messages are not screened (nor parsed twice)
            async for msg in inner_ss(requests, context):
                yield msg
            return
        # Closed with the call: a call that ends stops the handler's task at once.
        async with contextlib.aclosing(
            _screened_stream(inner_ss, requests, context, authorizer, table, method, principal)
        ) as answers:
            async for msg in answers:
                yield msg

    return grpc.stream_stream_rpc_method_handler(stream_stream_, None, handler.response_serializer)


async def _screened_stream(
    inner: Any,
    requests: AsyncIterator[bytes],
    context: Context,
    authorizer: Authorizer,
    table: Mapping[str, Access],
    method: str,
    principal: Principal,
) -> AsyncGenerator[Message, None]:
    """The answers of the stream handler ``inner`` to ``requests``, each request screened for ``principal`` first."""
    # Each message is screened on its way in; a refused one is answered here, in among the handler's answers
    # (or, for a method without a refusal, ends the stream through the handler as its own errors do).
    answers: asyncio.Queue[Any] = asyncio.Queue(SCREENED_ANSWERS_MAX)  # a slow reader slows the stream down

    async def screened() -> AsyncIterator[Message]:
        async for raw in requests:
            request, refusal = authorizer.screen(table, method, principal, raw, parse)
            if refusal is not None:
                await answers.put(refusal)
            if request is not None:
                yield request  # parsed: the handler's parse() takes it as it is

    async def pump() -> None:
        try:
            async for msg in inner(screened(), context):
                await answers.put(msg)
        except Exception as exc:  # handed to the response stream, which raises it
            await answers.put(exc)
            return
        await answers.put(_END)

    task = asyncio.create_task(pump())
    try:
        while True:
            item = await answers.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
