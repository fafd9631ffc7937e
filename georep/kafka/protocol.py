"""The Kafka wire protocol at the frame level. Pure: bytes in, requests and response bytes out.

The encodings are kafka-python's (``kafka.protocol``, 3.x): its request and response classes are
generated from Apache Kafka's own JSON message specs, flexible versions (compact fields, tagged fields)
included, so this module writes no field encoding itself. What it adds:

* :class:`FrameReader` splits a byte stream into frames (a 4-byte big-endian size, then the frame), with
  a bound on the size that is checked before the frame is buffered, and that may change between frames.
* :func:`decode_request` reads a frame's request header and body for the APIs and versions in
  :data:`SUPPORTED` and returns a :class:`Request`; any other API or version is an :class:`Unsupported`
  that still carries the correlation id, so the gateway answers it with an error code
  (:func:`error_response`) and never drops the connection.
* :func:`encode_response` frames a response with the header its request's version calls for.

Why answer instead of closing: Kafka closes the connection on an unknown API key, which a client reports
as a network error and retries forever; an ``UNSUPPORTED_VERSION`` names the problem.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kafka.protocol import admin as kadmin
from kafka.protocol import consumer as kconsumer
from kafka.protocol import metadata as kmetadata
from kafka.protocol import producer as kproducer
from kafka.protocol import sasl as ksasl

from georep.kafka.connections import FRAME_BYTES_MAX as MAX_FRAME_BYTES

_SIZE = struct.Struct(">i")
_HEAD = struct.Struct(">hhi")  # api key, api version, correlation id

NONE = 0
UNKNOWN_SERVER_ERROR = -1
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42

# API key -> (request class, response class, lowest version served, highest version served).
# The lowest is the oldest version the codec's schema still describes (Kafka 4 dropped older ones); the
# highest stops before versions that need what georep lacks (topic ids in Produce/Fetch 13+, the
# KIP-848 consumer group fields, batched coordinator lookups).
SUPPORTED: dict[int, tuple[Any, Any, int, int]] = {
    0: (kproducer.ProduceRequest, kproducer.ProduceResponse, 3, 9),
    1: (kconsumer.FetchRequest, kconsumer.FetchResponse, 4, 12),
    2: (kconsumer.ListOffsetsRequest, kconsumer.ListOffsetsResponse, 1, 7),
    3: (kmetadata.MetadataRequest, kmetadata.MetadataResponse, 0, 12),
    8: (kconsumer.OffsetCommitRequest, kconsumer.OffsetCommitResponse, 2, 8),
    9: (kconsumer.OffsetFetchRequest, kconsumer.OffsetFetchResponse, 1, 7),
    10: (kmetadata.FindCoordinatorRequest, kmetadata.FindCoordinatorResponse, 0, 3),
    11: (kconsumer.JoinGroupRequest, kconsumer.JoinGroupResponse, 0, 7),
    12: (kconsumer.HeartbeatRequest, kconsumer.HeartbeatResponse, 0, 4),
    13: (kconsumer.LeaveGroupRequest, kconsumer.LeaveGroupResponse, 0, 4),
    14: (kconsumer.SyncGroupRequest, kconsumer.SyncGroupResponse, 0, 5),
    15: (kadmin.DescribeGroupsRequest, kadmin.DescribeGroupsResponse, 0, 5),
    16: (kadmin.ListGroupsRequest, kadmin.ListGroupsResponse, 0, 4),
    17: (ksasl.SaslHandshakeRequest, ksasl.SaslHandshakeResponse, 0, 1),  # both SASL APIs: georep/kafka/server.py
    18: (kmetadata.ApiVersionsRequest, kmetadata.ApiVersionsResponse, 0, 3),
    19: (kadmin.CreateTopicsRequest, kadmin.CreateTopicsResponse, 2, 7),
    20: (kadmin.DeleteTopicsRequest, kadmin.DeleteTopicsResponse, 1, 6),
    22: (kproducer.InitProducerIdRequest, kproducer.InitProducerIdResponse, 0, 4),
    23: (kconsumer.OffsetForLeaderEpochRequest, kconsumer.OffsetForLeaderEpochResponse, 2, 4),
    32: (kadmin.DescribeConfigsRequest, kadmin.DescribeConfigsResponse, 1, 4),
    33: (kadmin.AlterConfigsRequest, kadmin.AlterConfigsResponse, 0, 2),  # refused per resource, with the reason
    35: (kadmin.DescribeLogDirsRequest, kadmin.DescribeLogDirsResponse, 1, 4),
    37: (kadmin.CreatePartitionsRequest, kadmin.CreatePartitionsResponse, 0, 3),  # refused per topic, with the reason
    36: (ksasl.SaslAuthenticateRequest, ksasl.SaslAuthenticateResponse, 0, 2),
    42: (kadmin.DeleteGroupsRequest, kadmin.DeleteGroupsResponse, 0, 2),
    44: (kadmin.IncrementalAlterConfigsRequest, kadmin.IncrementalAlterConfigsResponse, 0, 1),  # refused, as 33
    47: (kconsumer.OffsetDeleteRequest, kconsumer.OffsetDeleteResponse, 0, 0),
    60: (kadmin.DescribeClusterRequest, kadmin.DescribeClusterResponse, 0, 2),
}
API_VERSIONS = 18
SASL_HANDSHAKE = 17
SASL_AUTHENTICATE = 36


class FrameTooLarge(ValueError):
    """A frame size above the reader's bound or below zero: the connection cannot be framed again."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes (at most {limit})")
        self.size = size
        self.limit = limit


class FrameReader:
    """Frames from a byte stream, one at a time, as they complete.

    A frame's size is checked against :attr:`max_frame_bytes` as soon as its 4-byte header is there: a read that
    completes the size of the next frame is refused before any of it is kept. The bound is read again for each
    frame, so a listener raises it between two frames, once the client has authenticated (georep/kafka/server.py).
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts: consumed bytes are dropped at the next feed, not per frame

    def feed(self, data: bytes) -> None:
        """Add the bytes of one read; raises :class:`FrameTooLarge` before keeping them if they complete the size
        of a frame over the bound (the frames before it must have been taken with :meth:`next_frame`)."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        if len(self._buf) < 4 <= len(self._buf) + len(data):
            (size,) = _SIZE.unpack(bytes(self._buf) + data[: 4 - len(self._buf)])
            self._refuse_over_bound(size)
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete frame, or None until more bytes come; raises :class:`FrameTooLarge`."""
        size = self._check_size()
        if size is None or len(self._buf) - self._pos - 4 < size:
            return None
        start = self._pos + 4
        with memoryview(self._buf) as view:  # one copy out of the buffer, not a slice and then a copy of it
            frame = bytes(view[start : start + size])
        self._pos = start + size
        return frame

    def _check_size(self) -> int | None:
        if len(self._buf) - self._pos < 4:
            return None
        (size,) = _SIZE.unpack_from(self._buf, self._pos)
        self._refuse_over_bound(size)
        return int(size)

    def _refuse_over_bound(self, size: int) -> None:
        if not 0 <= size <= self.max_frame_bytes:
            raise FrameTooLarge(size, self.max_frame_bytes)


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    version: int
    correlation_id: int
    client_id: str
    body: Any  # the kafka-python request object


@dataclass(frozen=True, slots=True)
class Unsupported:
    api_key: int
    version: int
    correlation_id: int
    reason: str


def decode_request(frame: bytes) -> Request | Unsupported:
    """Raises ``ValueError`` only for a frame too short to hold a request header (nothing to answer)."""
    if len(frame) < _HEAD.size:
        raise ValueError(f"request of {len(frame)} bytes has no header")
    api_key, version, correlation_id = _HEAD.unpack_from(frame, 0)
    entry = SUPPORTED.get(api_key)
    if entry is None:
        return Unsupported(api_key, version, correlation_id, f"API key {api_key} is not served by georep")
    req_cls, _resp_cls, low, high = entry
    if not low <= version <= high:
        return Unsupported(
            api_key, version, correlation_id, f"API key {api_key} version {version} is outside {low}..{high}"
        )
    try:
        body = req_cls.decode(frame, version=version, header=True)
    except Exception as exc:  # the codec raises several types for malformed bytes
        return Unsupported(api_key, version, correlation_id, f"malformed request: {exc}")
    return Request(api_key, version, correlation_id, body.header.client_id or "", body)


def encode_response(api_key: int, version: int, correlation_id: int, response: Any) -> bytes:
    """The framed response bytes (size, header, body) for a request of ``api_key`` at ``version``."""
    response.API_VERSION = version
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def api_versions_body(version: int, error_code: int = NONE) -> Any:
    resp_cls = kmetadata.ApiVersionsResponse
    keys = [
        resp_cls.ApiVersion(api_key=k, min_version=low, max_version=high)
        for k, (_q, _r, low, high) in sorted(SUPPORTED.items())
    ]
    return resp_cls(version=version, error_code=error_code, api_keys=keys, throttle_time_ms=0)


def sasl_handshake_body(version: int, error_code: int, mechanisms: list[str]) -> Any:
    return ksasl.SaslHandshakeResponse(version=version, error_code=error_code, mechanisms=mechanisms)


def sasl_authenticate_body(version: int, error_code: int, message: str | None, auth_bytes: bytes) -> Any:
    return ksasl.SaslAuthenticateResponse(
        version=version, error_code=error_code, error_message=message, auth_bytes=auth_bytes, session_lifetime_ms=0
    )


def error_response(unsupported: Unsupported) -> bytes:
    """The answer to an API or version the gateway does not serve.

    ApiVersions at a version above ours gets Kafka's own answer: a v0 response with ``UNSUPPORTED_VERSION``
    and the supported ranges, from which the client picks a version it shares. A known API gets its response
    type at the nearest version we serve with ``UNSUPPORTED_VERSION`` in its top-level error code field, if it
    has one (or ``INVALID_REQUEST`` for malformed bytes). An API we do not serve gets its own response type
    (the codec knows them all) at the version asked, empty but for that error code: clients of such APIs
    (admin tools) report the error rather than hang on a closed connection. Only a key or version the codec
    does not know gets a bare header and the error code."""
    u = unsupported
    code = INVALID_REQUEST if u.reason.startswith("malformed") else UNSUPPORTED_VERSION
    if u.api_key == API_VERSIONS:
        return encode_response(API_VERSIONS, 0, u.correlation_id, api_versions_body(0, UNSUPPORTED_VERSION))
    entry = SUPPORTED.get(u.api_key)
    if entry is not None:
        _req, resp_cls, low, high = entry
        version = min(max(u.version, low), high)
    else:
        resp_cls = _KNOWN_RESPONSES.get(u.api_key)
        version = u.version
        if resp_cls is None or not 0 <= version <= resp_cls.max_version:
            body = _HEAD.pack(0, 0, u.correlation_id)[4:] + struct.pack(">h", code)
            return _SIZE.pack(len(body)) + body
    resp = resp_cls(version=version)
    if "error_code" in set(resp_cls.fields):
        resp.error_code = code
    return encode_response(u.api_key, version, u.correlation_id, resp)


def failure_response(api_key: int, version: int, correlation_id: int) -> bytes:
    """The answer to a served request whose handler failed: its response type at its version, empty but for
    ``UNKNOWN_SERVER_ERROR`` in the top-level error code if it has one (the client retries or reports it)."""
    _req, resp_cls, _low, _high = SUPPORTED[api_key]
    resp = resp_cls(version=version)
    if "error_code" in set(resp_cls.fields):
        resp.error_code = UNKNOWN_SERVER_ERROR
    return encode_response(api_key, version, correlation_id, resp)


def _known_responses() -> dict[int, Any]:
    """Every response type the codec knows, by API key: an API the gateway does not serve is still answered in
    its own response layout, so the client parses the error code rather than garbage."""
    out: dict[int, Any] = {}
    for module in (kadmin, kconsumer, kmetadata, kproducer, ksasl):
        for name in dir(module):
            cls = getattr(module, name)
            if name.endswith("Response") and isinstance(getattr(cls, "API_KEY", None), int):
                out[cls.API_KEY] = cls
    return out


_KNOWN_RESPONSES = _known_responses()
