"""JSON-RPC 2.0 over newline-delimited frames: codes, framing and a dispatcher.

This module is the one implementation of the wire format, shared by the worker
SDK (the client side) and the host's bridge server. It imports nothing outside
the standard library.

Framing: each frame is one JSON text encoded as UTF-8 and terminated by ``\\n``.
A frame never contains a raw newline (every JSON encoder escapes newlines inside
strings; pretty-printed JSON must be compacted before it is sent). Blank lines
are ignored. A frame longer than the receiver's limit is discarded up to its
newline and answered with an Invalid Request error; the connection survives.

The dispatcher answers exactly as the JSON-RPC 2.0 specification says:

* ``-32700`` Parse error: the frame is not JSON (id ``null``);
* ``-32600`` Invalid Request: not a Request object; an empty batch is one such
  error (not an array), every invalid element of a batch gets its own;
* ``-32601`` Method not found; ``-32602`` Invalid params; ``-32603`` Internal error;
* a Notification (no ``id`` member) is never answered, even on error, and a batch
  of only notifications is answered with nothing at all.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import json.decoder
import json.scanner
import logging
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

logger = logging.getLogger(__name__)

JSONRPC_VERSION = "2.0"

# The specification's pre-defined codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

STANDARD_MESSAGES = {
    PARSE_ERROR: "Parse error",
    INVALID_REQUEST: "Invalid Request",
    METHOD_NOT_FOUND: "Method not found",
    INVALID_PARAMS: "Invalid params",
    INTERNAL_ERROR: "Internal error",
}

# The UGENT bridge's application codes, inside the spec's server-error range
# -32099..-32000. docs/plugin-protocol.md documents each one.
NOT_AUTHENTICATED = -32001      # any method but hello before a successful hello
AUTHENTICATION_FAILED = -32002  # hello with a wrong plugin id or token
UNKNOWN_DELIVERY = -32003       # outbound.ack names a delivery the host never handed to this plugin
MEDIA_NOT_FOUND = -32004        # media.get names no stored media (or it expired)
MEDIA_TOO_LARGE = -32005        # media.put over the host's limit
HOST_UNAVAILABLE = -32006       # the host cannot serve the call now; retry later
RATE_LIMITED = -32007           # inbound.submit over the plugin's submit rate; retry after data.retry_after_secs

APPLICATION_MESSAGES = {
    NOT_AUTHENTICATED: "Not authenticated: call hello first",
    AUTHENTICATION_FAILED: "Authentication failed",
    UNKNOWN_DELIVERY: "Unknown delivery",
    MEDIA_NOT_FOUND: "Media not found",
    MEDIA_TOO_LARGE: "Media too large",
    HOST_UNAVAILABLE: "Host unavailable",
    RATE_LIMITED: "Rate limited",
}

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


class RPCError(Exception):
    """A JSON-RPC error object as an exception: raise it from a method to answer with it."""

    def __init__(self, code: int, message: str | None = None, data: Any = None):
        self.code = int(code)
        self.message = message or STANDARD_MESSAGES.get(code) or APPLICATION_MESSAGES.get(code) or "Server error"
        self.data = data
        super().__init__(f"{self.code} {self.message}")

    def to_dict(self) -> dict:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err

    @classmethod
    def from_dict(cls, err: Any) -> "RPCError":
        if not isinstance(err, dict):
            return cls(INTERNAL_ERROR, "Malformed error object", data=err)
        code = err.get("code")
        if isinstance(code, bool) or not isinstance(code, int):
            code = INTERNAL_ERROR
        return cls(code, str(err.get("message") or ""), err.get("data"))


class InvalidParams(RPCError):
    """-32602 whose message names the offending field, e.g. ``Invalid params: message.text: required``."""

    def __init__(self, reason: str, *, field: str | None = None):
        message = f"Invalid params: {field}: {reason}" if field else f"Invalid params: {reason}"
        super().__init__(INVALID_PARAMS, message, {"field": field, "reason": reason} if field else None)
        self.field = field
        self.reason = reason


# ---------------------------------------------------------------------------
# Frame building and parsing


def encode_frame(obj: Any) -> bytes:
    """One compact JSON text plus the terminating newline (ASCII-safe for any reader)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; Python's parser accepts them unless told not to.
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # 1e999 is read as inf: Infinity by another name, which no answer could carry back (encode_frame refuses it).
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is past a float's range")
    return value


def parse_frame(frame: bytes | str) -> Any:
    """Parse one frame; raises ``RPCError(PARSE_ERROR)`` for anything that is not JSON."""
    return _parse(frame, json.loads)


# json.scanner's pure-Python scanner reads numbers with a regex whose \d takes any Unicode digit ('[1\u0662]' is [12]);
# the C scanner, json.loads, takes ASCII digits only. The same scanner function, made to see an ASCII-only regex:
_ASCII_NUMBER_RE = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_py_make_scanner = types.FunctionType(json.scanner.py_make_scanner.__code__,
                                      {**vars(json.scanner), "NUMBER_RE": _ASCII_NUMBER_RE})


def _yielding_loads(text: str, **kwargs: Any) -> Any:
    decoder = json.decoder.JSONDecoder(**kwargs)
    decoder.scan_once = _py_make_scanner(decoder)  # (strings are still read by the C scanstring)
    return decoder.decode(text)


def parse_large_frame(frame: bytes | str) -> Any:
    """``parse_frame``'s answer (the same value, the same errors) by the pure-Python scanner, for a thread; but for
    nesting: it recurses twice per level, so a frame nested deeper than some 490 levels (json.loads: some 990) is a
    parse error here (no protocol message nests more than a few).

    The C parser holds the GIL for the whole of one ``json.loads``: a 16 MiB frame of small objects run in a thread
    still stops every other thread (the event loop) for its whole parse, some 400 ms. The Python scanner lets them run
    between its steps. It is slower on such a frame, about as fast on one long string (``media.put``'s base64)."""
    return _parse(frame, _yielding_loads)


def _parse(frame: bytes | str, loads: Callable[..., Any]) -> Any:
    try:
        text = frame.decode("utf-8") if isinstance(frame, (bytes, bytearray)) else frame
        return loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RPCError(PARSE_ERROR) from exc


def request(method: str, params: Any = None, id: Any = None) -> dict:
    """A Request object (``id`` given) for ``encode_frame``."""
    obj: dict[str, Any] = {"jsonrpc": JSONRPC_VERSION, "method": method}
    if params is not None:
        obj["params"] = params
    obj["id"] = id
    return obj


def notification(method: str, params: Any = None) -> dict:
    """A Notification object (no ``id`` member): the receiver never answers it."""
    obj: dict[str, Any] = {"jsonrpc": JSONRPC_VERSION, "method": method}
    if params is not None:
        obj["params"] = params
    return obj


def result_response(id: Any, result: Any) -> dict:
    return {"jsonrpc": JSONRPC_VERSION, "result": result, "id": id}


def error_response(id: Any, error: RPCError) -> dict:
    return {"jsonrpc": JSONRPC_VERSION, "error": error.to_dict(), "id": id}


@dataclass(frozen=True)
class FrameTooLarge:
    """Marker the splitter yields in place of a frame over the limit (already discarded)."""

    size: int
    limit: int

    def error(self) -> RPCError:
        return RPCError(INVALID_REQUEST, data={"reason": "frame too large", "max_frame_bytes": self.limit})


def batch_too_long(size: int, limit: int) -> RPCError:
    """-32600 for a batch of more calls than the receiver runs at once: refused whole, none of its calls run.

    The batch as a whole is invalid, so, as for an empty batch, the answer is one Response object with
    ``id`` null rather than an array (JSON-RPC 2.0, Batch).
    """
    return RPCError(INVALID_REQUEST, f"Invalid Request: a batch of {size} calls is over the limit of {limit}",
                    data={"reason": "batch too long", "size": size, "max_batch_calls": limit})


class LineSplitter:
    """Splits a byte stream into frames, bounding memory by ``max_frame_bytes``.

    A frame over the limit is not buffered: its bytes are dropped as they arrive
    until its newline, and a single ``FrameTooLarge`` stands in for it, so one
    huge line costs neither memory nor the connection.

    ``frames`` yields them one at a time and reads the limit before each: a receiver that changes it on a
    frame (the bridge, on a successful ``hello``) has the next frame of the same bytes cut by the new one.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._discarding = 0  # bytes dropped so far of an oversized frame; 0 when not discarding

    def feed(self, data: bytes) -> list[bytes | FrameTooLarge]:
        return list(self.frames(data))

    def frames(self, data: bytes) -> Iterator[bytes | FrameTooLarge]:
        """The frames ``data`` completes, in order; consume it whole (the rest of ``data`` is read as it goes)."""
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if self._discarding:
                if nl < 0:
                    self._discarding += len(data) - pos
                    return
                size, self._discarding = self._discarding + nl - pos, 0
                pos = nl + 1
                yield FrameTooLarge(size, self.max_frame_bytes)
                continue
            if nl < 0:
                self._buf += data[pos:]
                if len(self._buf) > self.max_frame_bytes:
                    self._discarding = len(self._buf)
                    self._buf = bytearray()
                return
            chunk = data[pos:nl]
            pos = nl + 1
            if len(self._buf) + len(chunk) > self.max_frame_bytes:
                size = len(self._buf) + len(chunk)
                self._buf = bytearray()
                yield FrameTooLarge(size, self.max_frame_bytes)
            else:
                self._buf += chunk
                line = bytes(self._buf).rstrip(b"\r")
                self._buf = bytearray()
                if line.strip():
                    yield line


# ---------------------------------------------------------------------------
# Dispatcher

Handler = Callable[..., Any]

_NO_ID = object()  # distinguishes "no id member" (a notification) from "id": null


@dataclass
class _Call:
    id: Any
    handler: Handler
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)

    @property
    def is_notification(self) -> bool:
        return self.id is _NO_ID

    @property
    def response_id(self) -> Any:
        return None if self.id is _NO_ID else self.id


def _valid_id(value: Any) -> bool:
    return value is None or isinstance(value, str) or (
        isinstance(value, (int, float)) and not isinstance(value, bool))


class Dispatcher:
    """Routes Request objects to a method table and builds the spec's responses.

    ``methods`` maps a method name to a callable; positional params are passed
    as ``*args`` and named params as ``**kwargs``. Params that do not bind to the
    callable's signature are ``-32602``. A method may raise ``RPCError`` (or
    ``InvalidParams``) to answer with that error; any other exception becomes
    ``-32603`` and is logged, never shown to the peer. Handlers may be plain
    functions or coroutines; ``handle_frame`` runs only plain ones,
    ``handle_frame_async`` both (a batch's calls run concurrently).
    """

    def __init__(self, methods: Mapping[str, Handler]):
        self.methods = dict(methods)
        self._signatures: dict[str, inspect.Signature | None] = {}

    # -- parsing and validation -------------------------------------------------

    def _signature(self, name: str, handler: Handler) -> inspect.Signature | None:
        if name not in self._signatures:
            try:
                self._signatures[name] = inspect.signature(handler)
            except (TypeError, ValueError):
                self._signatures[name] = None
        return self._signatures[name]

    def _prepare(self, obj: Any) -> _Call | dict:
        """A call to run, or the error response that answers ``obj`` right away."""
        if not isinstance(obj, dict):
            return error_response(None, RPCError(INVALID_REQUEST))
        raw_id = obj.get("id", _NO_ID)
        id_ok = raw_id is _NO_ID or _valid_id(raw_id)
        method = obj.get("method")
        params = obj.get("params", _NO_ID)
        if (obj.get("jsonrpc") != JSONRPC_VERSION or not isinstance(method, str) or not id_ok
                or (params is not _NO_ID and not isinstance(params, (list, dict)))):
            # The id is echoed when it could be read; otherwise it is null, as the spec says.
            rid = raw_id if (id_ok and raw_id is not _NO_ID) else None
            return error_response(rid, RPCError(INVALID_REQUEST))
        handler = None if method.startswith("rpc.") else self.methods.get(method)
        if handler is None:
            return _ErrorCall(raw_id, RPCError(METHOD_NOT_FOUND))
        args: list = list(params) if isinstance(params, list) else []
        kwargs: dict = dict(params) if isinstance(params, dict) else {}
        sig = self._signature(method, handler)
        if sig is not None:
            try:
                sig.bind(*args, **kwargs)
            except TypeError as exc:
                return _ErrorCall(raw_id, RPCError(INVALID_PARAMS, data={"reason": str(exc)}))
        return _Call(raw_id, handler, args, kwargs)

    @staticmethod
    def _finish(call: _Call, outcome: Any, error: RPCError | None) -> dict | None:
        if call.is_notification:
            return None
        if error is not None:
            return error_response(call.response_id, error)
        try:
            # Catch an unserialisable result here, where it can still become -32603.
            json.dumps(outcome, allow_nan=False)
        except (TypeError, ValueError):
            logger.exception("method result is not JSON-serialisable")
            return error_response(call.response_id, RPCError(INTERNAL_ERROR))
        return result_response(call.response_id, outcome)

    @staticmethod
    def _internal(exc: BaseException) -> RPCError:
        logger.error("JSON-RPC method failed", exc_info=exc)
        return RPCError(INTERNAL_ERROR)

    # -- synchronous ------------------------------------------------------------

    def _run_sync(self, prepared: _Call | dict) -> dict | None:
        if isinstance(prepared, dict):
            return prepared
        if isinstance(prepared, _ErrorCall):
            return self._finish(prepared, None, prepared.error)
        try:
            outcome = prepared.handler(*prepared.args, **prepared.kwargs)
            if inspect.isawaitable(outcome):
                if inspect.iscoroutine(outcome):
                    outcome.close()  # avoid the "never awaited" warning
                raise TypeError("coroutine method used with the synchronous dispatcher")
        except RPCError as exc:
            return self._finish(prepared, None, exc)
        except Exception as exc:  # noqa: BLE001 - every other failure is -32603 by the spec
            return self._finish(prepared, None, self._internal(exc))
        return self._finish(prepared, outcome, None)

    def handle_obj(self, obj: Any) -> Any:
        """The response to a parsed frame: an object, a list (batch), or None (nothing to send)."""
        if isinstance(obj, list):
            if not obj:
                return error_response(None, RPCError(INVALID_REQUEST))
            responses = [r for r in (self._run_sync(self._prepare(o)) for o in obj) if r is not None]
            return responses or None
        return self._run_sync(self._prepare(obj))

    def handle_frame(self, frame: bytes | str | FrameTooLarge) -> bytes | None:
        """One incoming frame to the outgoing frame (with newline), or None."""
        try:
            obj = self.frame_obj(frame)
        except RPCError as exc:
            return encode_frame(error_response(None, exc))
        return _encode_or_none(self.handle_obj(obj))

    # -- asynchronous -----------------------------------------------------------

    async def _run_async(self, prepared: _Call | dict) -> dict | None:
        if isinstance(prepared, dict):
            return prepared
        if isinstance(prepared, _ErrorCall):
            return self._finish(prepared, None, prepared.error)
        try:
            outcome = prepared.handler(*prepared.args, **prepared.kwargs)
            if inspect.isawaitable(outcome):
                outcome = await outcome
        except RPCError as exc:
            return self._finish(prepared, None, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            return self._finish(prepared, None, self._internal(exc))
        return self._finish(prepared, outcome, None)

    async def handle_obj_async(self, obj: Any, call_done: Callable[[], None] | None = None) -> Any:
        """The response to a parsed frame; ``call_done`` is called as each of its calls finishes (once for a
        frame that is not a batch, or an empty one), before the batch as a whole is answered."""
        if isinstance(obj, list) and obj:
            results = await asyncio.gather(*(self._run_async_then(o, call_done) for o in obj))
            responses = [r for r in results if r is not None]
            return responses or None
        return await self._run_async_then(obj, call_done)

    async def _run_async_then(self, obj: Any, call_done: Callable[[], None] | None) -> dict | None:
        try:
            if isinstance(obj, list):  # (an empty batch: one invalid request)
                return error_response(None, RPCError(INVALID_REQUEST))
            return await self._run_async(self._prepare(obj))
        finally:
            if call_done is not None:
                call_done()

    async def handle_frame_async(self, frame: bytes | str | FrameTooLarge) -> bytes | None:
        try:
            obj = self.frame_obj(frame)
        except RPCError as exc:
            return encode_frame(error_response(None, exc))
        return _encode_or_none(await self.handle_obj_async(obj))

    @staticmethod
    def frame_obj(frame: bytes | str | FrameTooLarge) -> Any:
        """The parsed frame, or raise the ``RPCError`` that answers it (parse error, frame too large)."""
        if isinstance(frame, FrameTooLarge):
            raise frame.error()
        return parse_frame(frame)


class _ErrorCall(_Call):
    """A call already known to fail (unknown method, unbindable params): answered unless a notification."""

    def __init__(self, id: Any, error: RPCError):
        super().__init__(id, _never)
        self.error = error


def _never(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - placeholder handler
    raise AssertionError("never called")


def _encode_or_none(response: Any) -> bytes | None:
    return None if response is None else encode_frame(response)

