"""An OPM chat engine for any OpenAI-compatible ``/chat/completions`` upstream.

Talks to OpenAI, vLLM, llama.cpp, Ollama, LiteLLM, OpenRouter and the like over
one pooled ``httpx.Client`` per engine instance. Besides the OPM ``ChatEngine``
contract it implements ``stream_events`` (see ``plugins_app.agent.engines.base``), so
reasoning, tool calls and answer text reach the client as they are generated.
This module imports nothing from Django.
"""
from __future__ import annotations

import json
import os
import threading
import uuid
from itertools import chain
from typing import Any, Dict, Iterator, List, Optional

import httpx
from ovos_plugin_manager.templates.agent_tools import ToolBox
from ovos_plugin_manager.templates.agents import (AgentMessage, ChatEngine, MessageRole,
                                                  ToolCall)

from plugins_app.agent.engines.base import (ANSWER, THINKING, TOOL, USAGE, EngineError, StopCheck,
                                      StreamItem, never_stop, usage_of)

DEFAULT_TIMEOUT = 60.0
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_ERROR_TEXT_LIMIT = 500
_FLUSH = (b"\n",)


class _SetCookiesOnly(httpx.Cookies):
    """httpx's cookie store, minus its work on a response that sets no cookie.

    httpx builds two urllib compatibility objects for every response to look for ``Set-Cookie``
    (py-spy: 11% of the embedded daemon's Python time per turn, more than the rest of the upstream
    call). An upstream that sets cookies (a load balancer's affinity, say) is still honoured: the
    stock extraction runs whenever the header is there."""

    def extract_cookies(self, response: httpx.Response) -> None:
        headers = response.headers
        if "set-cookie" in headers or "set-cookie2" in headers:
            super().extract_cookies(response)


def pooled_client(**kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` whose cookie store skips responses that set no cookie."""
    client = httpx.Client(**kwargs)
    client._cookies = _SetCookiesOnly(client.cookies.jar)  # the store httpx reads on every response
    return client


class UpstreamError(EngineError):
    """An ``EngineError`` raised for an upstream failure; ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, *, code: str = "upstream_error",
                 status: Optional[int] = None):
        super().__init__(message, code=code)
        self.status = status


class OpenAICompatibleEngine(ChatEngine):
    """Chat engine for any server speaking the OpenAI Chat Completions API.

    Config keys (missing ones fall back to the environment, read at construction):

    * ``base_url``: the ``/v1`` root, e.g. ``http://127.0.0.1:8000/v1`` (``UGENT_LLM_BASE_URL``)
    * ``api_key``: sent as ``Authorization: Bearer ...`` when set (``UGENT_LLM_API_KEY``)
    * ``model``: the model name (``UGENT_LLM_MODEL``); omitted from the request when empty
    * ``system_prompt``: merged into the leading system message (or prepended as one)
    * ``temperature``, ``max_tokens``: sent only when set
    * ``timeout``: seconds for connect and for each read (so between stream chunks); default 60
    * ``extra_body``: dict merged last into every request body (provider-specific
      parameters; a key set to None removes a field the engine would send)
    * ``developer_role``: wire role for ``MessageRole.DEVELOPER`` messages; default
      ``"system"`` because most non-OpenAI servers reject ``"developer"``
    * ``stream_usage``: ask a streamed completion for its token usage
      (``stream_options.include_usage``), yielded as one ``USAGE`` item; default true

    Errors surface as ``EngineError`` (``UpstreamError``) with code
    ``upstream_unavailable`` (cannot connect), ``upstream_timeout``,
    ``upstream_error`` (non-2xx, an error object in the body or the stream,
    malformed JSON, a connection dropped mid-response) or ``engine_misconfigured``.

    Tool calls in ``stream_events``: the streamed pieces are assembled per
    ``index``; a call is emitted as one ``TOOL`` item (``data`` = ``{"index", "id",
    "name", "arguments"}``, ``arguments`` the raw JSON string) as soon as it is
    complete, i.e. when a piece for a later index arrives, when the choice
    reports a ``finish_reason``, or at the end of the stream. Servers send calls
    one after another, so each call is normally emitted once; should a server
    interleave and add pieces to a call already emitted, the call is emitted
    again at the end with the same ``id``, superseding the earlier item.
    """

    supports_tools = True

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        super().__init__(config)
        cfg = self.config
        env = os.environ
        self.base_url: str = str(cfg.get("base_url") or env.get("UGENT_LLM_BASE_URL") or "").rstrip("/")
        self.api_key: str = str(cfg.get("api_key") or env.get("UGENT_LLM_API_KEY") or "")
        self.model: str = str(cfg.get("model") or env.get("UGENT_LLM_MODEL") or "")
        self.system_prompt: str = cfg.get("system_prompt") or ""
        self.temperature: Optional[float] = cfg.get("temperature")
        self.max_tokens: Optional[int] = cfg.get("max_tokens")
        timeout = cfg.get("timeout")
        self.timeout: float = float(timeout) if timeout not in (None, "") else DEFAULT_TIMEOUT
        extra = cfg.get("extra_body")
        self.extra_body: Dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}
        self.developer_role: str = cfg.get("developer_role") or "system"
        self.stream_usage: bool = cfg.get("stream_usage", True) not in (False, "false", "0", 0)
        self._url = self.base_url + "/chat/completions"
        self._client: Optional[httpx.Client] = None
        self._client_lock = threading.Lock()

    # -- client lifecycle ---------------------------------------------------

    @property
    def client(self) -> httpx.Client:
        """The pooled HTTP client, created on first use."""
        client = self._client
        if client is None:
            with self._client_lock:
                client = self._client
                if client is None:
                    headers = {"Accept": "application/json"}
                    if self.api_key:
                        headers["Authorization"] = "Bearer " + self.api_key
                    client = pooled_client(
                        headers=headers,
                        timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                        limits=httpx.Limits(max_connections=100, max_keepalive_connections=32),
                    )
                    self._client = client
        return client

    def close(self) -> None:
        """Release the pooled connections; a later call opens a new client."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "OpenAICompatibleEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- request building -----------------------------------------------------

    def convert_messages(self, messages: List[Any]) -> List[Dict[str, Any]]:
        """Convert ``AgentMessage``s (or ready OpenAI dicts) into the wire format.

        Leading system/developer messages and the configured ``system_prompt``
        are merged into one system message: several chat templates (llama.cpp,
        vLLM) reject a conversation that opens with more than one.
        """
        out: List[Dict[str, Any]] = []
        lead: List[str] = [self.system_prompt] if self.system_prompt else []
        leading = True
        for m in messages:
            if isinstance(m, dict):
                out.append(m)
                leading = False
                continue
            role = getattr(m.role, "value", m.role)
            if role == "developer":
                role = self.developer_role
            if leading and role == "system":
                # the same text once: a profile's memory engine starts its context with the profile's system
                # prompt (seed 001), which this engine was given as its own too
                if m.content and m.content not in lead:
                    lead.append(m.content)
                continue
            leading = False
            if role == "tool":
                out.append({"role": "tool", "content": m.content or "",
                            "tool_call_id": m.tool_call_id or ""})
            elif role == "assistant" and m.tool_calls:
                out.append({
                    "role": "assistant",
                    # OpenAI wants null, not "", on a turn that only calls tools
                    "content": m.content or None,
                    "tool_calls": [
                        {"id": tc.id, "type": "function",
                         "function": {"name": tc.name,
                                      "arguments": tc.arguments if isinstance(tc.arguments, str)
                                      else json.dumps(tc.arguments or {}, ensure_ascii=False)}}
                        for tc in m.tool_calls],
                })
            else:
                out.append({"role": role, "content": m.content or ""})
        if lead:
            out.insert(0, {"role": "system", "content": "\n\n".join(lead)})
        return out

    def build_payload(self, messages: List[Any], *, tools: Any = None,
                      stream: bool = False) -> Dict[str, Any]:
        """The JSON body for ``POST {base_url}/chat/completions``."""
        payload: Dict[str, Any] = {"messages": self.convert_messages(messages)}
        if self.model:
            payload["model"] = self.model
        if stream:
            payload["stream"] = True
            if self.stream_usage:
                payload["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            payload["temperature"] = self.temperature
        if self.max_tokens is not None:
            payload["max_tokens"] = self.max_tokens
        specs = ToolBox.normalize_tools(tools)
        if specs:
            payload["tools"] = specs
        for key, value in self.extra_body.items():
            if key == "messages":
                continue
            if value is None:
                payload.pop(key, None)
            else:
                payload[key] = value
        return payload

    def _check_configured(self) -> None:
        if not self.base_url:
            raise UpstreamError("no upstream configured: set base_url (or UGENT_LLM_BASE_URL)",
                                code="engine_misconfigured")

    # -- non-streaming --------------------------------------------------------

    def continue_chat(self, messages: List[AgentMessage],
                      session_id: str = "default",
                      lang: Optional[str] = None,
                      units: Optional[str] = None,
                      tools: Any = None) -> AgentMessage:
        """One non-streaming completion; ``tool_calls`` are parsed into ``ToolCall``s.

        ``<think>...</think>`` spans are removed from the returned content.
        """
        self._check_configured()
        payload = self.build_payload(messages, tools=tools)
        try:
            resp = self.client.post(self._url, json=payload)
            body = resp.content
        except Exception as exc:
            raise _transport_error(exc, self.base_url) from exc
        if resp.status_code >= 300:
            raise _status_error(resp.status_code, body)
        msg = _completion_message(body)
        content = _message_text(msg)
        if _THINK_OPEN in content or _THINK_CLOSE in content:
            content = _strip_think(content)
        tool_calls = None
        if msg.get("tool_calls"):
            tool_calls = []
            for tc in msg["tool_calls"]:
                fn = tc.get("function") or {}
                tool_calls.append(ToolCall(id=tc.get("id") or _new_call_id(),
                                           name=fn.get("name") or "",
                                           arguments=_parse_arguments(fn.get("arguments"))))
        return AgentMessage(role=MessageRole.ASSISTANT, content=content, tool_calls=tool_calls)

    # -- streaming --------------------------------------------------------------

    def stream_tokens(self, messages: List[AgentMessage],
                      session_id: str = "default",
                      lang: Optional[str] = None,
                      units: Optional[str] = None) -> Iterator[str]:
        """Stream the answer text as it is generated (reasoning is left out)."""
        for item in self.stream_events(messages, session_id=session_id, lang=lang):
            if item.kind == ANSWER:
                yield item.text

    def stream_events(self, messages: List[AgentMessage], *, session_id: str = "default",
                      lang: Optional[str] = None, tools: Any = None,
                      should_stop: StopCheck = never_stop) -> Iterator[StreamItem]:
        """Stream ANSWER, THINKING and TOOL items from one streamed completion.

        ``should_stop`` is checked between SSE lines; once it returns True the
        upstream response is closed (its connection is dropped, not reused) and
        the iterator ends. Upstream failures raise ``EngineError``, possibly after
        some items were already yielded.
        """
        self._check_configured()
        if should_stop():
            return
        payload = self.build_payload(messages, tools=tools, stream=True)
        client = self.client
        try:
            request = client.build_request("POST", self._url, json=payload,
                                           headers={"Accept": "text/event-stream"})
            response = client.send(request, stream=True)
        except Exception as exc:
            raise _transport_error(exc, self.base_url) from exc
        try:
            if response.status_code >= 300:
                try:
                    body = response.read()
                except Exception:
                    body = b""
                raise _status_error(response.status_code, body)
            if response.headers.get("content-type", "").startswith("application/json"):
                # A server that ignores "stream": true answers with one completion.
                body = response.read()
                yield from _completion_items(_completion_message(body))
                usage = _completion_usage(body)
                if usage is not None:
                    yield StreamItem(USAGE, data=usage)
            else:
                yield from self._parse_stream(response, should_stop)
        except EngineError:
            raise
        except Exception as exc:
            raise _transport_error(exc, self.base_url, mid_stream=True) from exc
        finally:
            response.close()

    def _parse_stream(self, response: httpx.Response,
                      should_stop: StopCheck) -> Iterator[StreamItem]:
        loads = json.loads
        think = _ThinkSplitter()
        calls: Dict[int, Dict[str, Any]] = {}
        emitted: Dict[int, int] = {}  # index -> len(arguments) when emitted
        current = -1  # highest tool call index seen
        done = False
        seen = False
        head = b""
        buf = b""
        # the trailing b"\n" flushes a last event sent without its newline
        for raw in chain(response.iter_bytes(), _FLUSH):
            if done:
                # Drain to the end of the body so the connection goes back to the pool.
                continue
            if buf:
                raw = buf + raw
            elif not seen and not head:
                head = raw[:200]
            lines = raw.split(b"\n")
            buf = lines.pop()
            for line in lines:
                if not line.startswith(b"data:"):
                    # blank separators, ": comments", "event:"/"id:"/"retry:" lines
                    continue
                if should_stop():
                    return
                seen = True
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if not data:
                    continue
                try:
                    obj = loads(data)
                except ValueError:
                    raise UpstreamError(f"upstream sent malformed JSON in the stream: "
                                        f"{_snippet(data)}") from None
                if not isinstance(obj, dict):
                    raise UpstreamError(f"upstream sent an unexpected stream event: {_snippet(data)}")
                if "error" in obj and obj["error"]:
                    raise UpstreamError(f"upstream error: {_error_text(obj['error'])}")
                usage = usage_of(obj.get("usage")) if obj.get("usage") else None
                if usage is not None:  # the final chunk of include_usage (or any chunk carrying it)
                    yield StreamItem(USAGE, data=usage)
                choices = obj.get("choices")
                if not choices:
                    continue  # e.g. the usage chunk
                choice = choices[0]
                delta = choice.get("delta") or {}
                items: List[StreamItem] = []
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning and isinstance(reasoning, str):
                    items.append(StreamItem(THINKING, reasoning))
                content = delta.get("content") or delta.get("refusal")
                if content and isinstance(content, str):
                    if think.passthrough(content):
                        items.append(StreamItem(ANSWER, content))
                    else:
                        items.extend(think.feed(content))
                tcs = delta.get("tool_calls")
                if tcs:
                    for tc in tcs:
                        idx = tc.get("index")
                        if not isinstance(idx, int):
                            # no index (non-conforming server): a piece without an id continues the last call
                            idx = current if current >= 0 and not tc.get("id") else current + 1
                        if idx > current:
                            # calls stream one after another: a new index completes the earlier ones
                            items.extend(_emit_calls(calls, emitted, below=idx))
                            current = idx
                        call = calls.get(idx)
                        if call is None:
                            call = calls[idx] = {"id": "", "name": "", "arguments": []}
                        if tc.get("id"):
                            call["id"] = tc["id"]
                        fn = tc.get("function") or {}
                        name = fn.get("name")
                        if name and name != call["name"]:
                            # some servers repeat the full name in every piece, others split it
                            call["name"] += name
                        if fn.get("arguments"):
                            args = fn["arguments"]
                            call["arguments"].append(args if isinstance(args, str)
                                                     else json.dumps(args, ensure_ascii=False))
                if choice.get("finish_reason") and calls:
                    items.extend(_emit_calls(calls, emitted))
                if items:
                    for item in items:
                        yield item
                    if should_stop():
                        return
        if not seen:
            raise UpstreamError("upstream sent no stream events" +
                                (f": {_snippet(head)}" if head.strip() else " (empty body)"))
        for item in think.flush():
            yield item
        for item in _emit_calls(calls, emitted):
            yield item


class _ThinkSplitter:
    """Splits streamed content into answer and ``<think>...</think>`` reasoning.

    Tags may arrive split across chunks, so a trailing fragment that could
    start a tag is held back until the next chunk decides it.
    """

    __slots__ = ("inside", "carry", "strip_ws")

    def __init__(self):
        self.inside = False
        self.carry = ""
        self.strip_ws = False

    def passthrough(self, text: str) -> bool:
        # The common case: plain answer text with no tag in sight.
        return not self.inside and not self.carry and not self.strip_ws and "<" not in text

    def feed(self, text: str) -> List[StreamItem]:
        if self.carry:
            text = self.carry + text
            self.carry = ""
        out: List[StreamItem] = []
        while text:
            tag = _THINK_CLOSE if self.inside else _THINK_OPEN
            i = text.find(tag)
            if i >= 0:
                self._add(out, text[:i])
                text = text[i + len(tag):]
                self.inside = not self.inside
                # The answer after a reasoning block starts with a blank line or two.
                self.strip_ws = not self.inside
                continue
            j = text.rfind("<", max(0, len(text) - len(tag) + 1))
            if j >= 0 and tag.startswith(text[j:]):
                self.carry = text[j:]
                text = text[:j]
            self._add(out, text)
            break
        return out

    def flush(self) -> List[StreamItem]:
        out: List[StreamItem] = []
        if self.carry:
            carry, self.carry = self.carry, ""
            self._add(out, carry)
        return out

    def _add(self, out: List[StreamItem], text: str) -> None:
        if not text:
            return
        if self.inside:
            out.append(StreamItem(THINKING, text))
            return
        if self.strip_ws:
            text = text.lstrip()
            if not text:
                return
            self.strip_ws = False
        out.append(StreamItem(ANSWER, text))


def _emit_calls(calls: Dict[int, Dict[str, Any]], emitted: Dict[int, int],
                below: Optional[int] = None) -> List[StreamItem]:
    out = []
    for idx in sorted(calls):
        if below is not None and idx >= below:
            break
        call = calls[idx]
        args = call["arguments"]
        if emitted.get(idx) == len(args):
            continue
        emitted[idx] = len(args)
        if not call["id"]:
            call["id"] = _new_call_id()
        out.append(StreamItem(TOOL, data={"index": idx, "id": call["id"], "name": call["name"],
                                          "arguments": "".join(args)}))
    return out


def _completion_usage(body: bytes) -> Optional[Dict[str, int]]:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return usage_of(data.get("usage")) if isinstance(data, dict) else None


def _completion_message(body: bytes) -> Dict[str, Any]:
    """The ``choices[0].message`` of a non-streamed completion body."""
    try:
        data = json.loads(body)
    except ValueError:
        raise UpstreamError(f"upstream sent a response that is not JSON: {_snippet(body)}") from None
    if not isinstance(data, dict):
        raise UpstreamError(f"upstream sent an unexpected response: {_snippet(body)}")
    if data.get("error"):
        raise UpstreamError(f"upstream error: {_error_text(data['error'])}")
    try:
        msg = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise UpstreamError(f"upstream response has no choices: {_snippet(body)}") from None
    return msg if isinstance(msg, dict) else {}


def _message_text(msg: Dict[str, Any]) -> str:
    content = msg.get("content") or msg.get("refusal") or ""
    if isinstance(content, list):  # content parts, as some servers return
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else str(content)


def _completion_items(msg: Dict[str, Any]) -> List[StreamItem]:
    items: List[StreamItem] = []
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning and isinstance(reasoning, str):
        items.append(StreamItem(THINKING, reasoning))
    think = _ThinkSplitter()
    items.extend(think.feed(_message_text(msg)))
    items.extend(think.flush())
    for idx, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args or {}, ensure_ascii=False)
        items.append(StreamItem(TOOL, data={"index": idx, "id": tc.get("id") or _new_call_id(),
                                            "name": fn.get("name") or "", "arguments": args}))
    return items


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_arguments(raw: Any) -> Dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def _strip_think(text: str) -> str:
    out = []
    pos = 0
    while True:
        start = text.find(_THINK_OPEN, pos)
        if start < 0:
            # A lone closing tag: the server swallowed the opening one into the prompt.
            end = text.find(_THINK_CLOSE, pos)
            if end >= 0 and not out:
                return text[end + len(_THINK_CLOSE):].lstrip()
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(_THINK_CLOSE, start)
        if end < 0:
            break
        pos = end + len(_THINK_CLOSE)
    return "".join(out).strip()


def _snippet(body: Any, limit: int = _ERROR_TEXT_LIMIT) -> str:
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode("utf-8", "replace")
    body = str(body).strip()
    return body if len(body) <= limit else body[:limit] + "..."


def _error_text(err: Any) -> str:
    """The readable part of an OpenAI-style error object (or whatever the server sent)."""
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or err.get("error")
        if isinstance(msg, (dict, list)):
            return _error_text(msg)
        if msg:
            return _snippet(msg)
        return _snippet(json.dumps(err, ensure_ascii=False))
    if isinstance(err, list) and err:
        return _error_text(err[0])
    return _snippet(err)


def _status_error(status: int, body: bytes) -> UpstreamError:
    text = ""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "detail", "message"):
            if data.get(key):
                text = _error_text(data[key])
                break
    if not text:
        text = _snippet(body) if body else httpx.codes.get_reason_phrase(status) or "no details"
    return UpstreamError(f"upstream returned HTTP {status}: {text}", status=status)


def _transport_error(exc: Exception, base_url: str, mid_stream: bool = False) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(f"upstream at {base_url} timed out ({type(exc).__name__})",
                             code="upstream_timeout")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError(f"cannot reach upstream at {base_url}: {exc or type(exc).__name__}",
                             code="upstream_unavailable")
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return UpstreamError(f"invalid upstream base_url {base_url!r}: {exc}",
                             code="engine_misconfigured")
    if isinstance(exc, httpx.TransportError):
        where = "during the response" if mid_stream else "before responding"
        return UpstreamError(f"upstream at {base_url} closed the connection {where}: "
                             f"{exc or type(exc).__name__}")
    return UpstreamError(f"upstream request failed: {type(exc).__name__}: {exc}")
