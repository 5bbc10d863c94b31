"""The Web Channel API: thin views over the hub's services.

The chat completion view is an async Django view rather than a DRF APIView:
it waits for a turn that runs in a Celery worker, and a sync view would hold
Django's single sync thread for the whole turn. It authenticates, validates
(with a DRF serializer) and renders errors exactly as the DRF views do.
"""
from __future__ import annotations

import asyncio
import logging
import contextvars
import re
import threading
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import JsonResponse, StreamingHttpResponse
from django.views import View
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from channels_app import api_docs as docs
from channels_app import files, notify, questions, services, statements
from channels_app.auth import IsOperator, authenticate_headers
from channels_app.bodies import json_object_parse, request_body, text_problem
from channels_app.errors import ApplicationError, error_response, from_drf
from channels_app.api_fields import IdentityFields, client_id_field, conversation_id_field
from channels_app.events import turn_topic
from channels_app.models import INPUT_MODES, Turn
from channels_app.sse import DONE, PING, TERMINAL, ChunkRenderer, usage_or_zero
from plugins_app.agent.profiles import model_get, models_list
from plugins_app.agent.warm import workers_warm

log = logging.getLogger("ugent.requests")

CONTENT_SHAPE = "the last user entry's content must be a string or a list of text parts."
NOT_A_TEXT_PART = ('content part {i} is not a text part ({{"type": "text", "text": "…"}}) or a file part '
                   '({{"type": "file", "file": {{"file_id": "…"}}}}): this daemon reads text and file parts only.')
# Rendered after the field's name ("ugent_allowed_tools: " + this), as every field's refusal is (errors.from_drf).
ALLOWED_TOOLS_EMPTY = ('[] is refused: leave the field out for no restriction, '
                       'or send ugent_denied_tools: ["*"] to run the turn with no tools.')
ONE_CHOICE_ONLY = "only 1 is supported: a turn gives one answer."


class ChatInputSerializer(IdentityFields):
    """The chat request: OpenAI's fields and the UGENT extensions (help_text is the spec's Purpose column)."""

    model = serializers.CharField(required=False, allow_blank=True, allow_null=True, help_text=(
        "The turn's own model; ugent-default, or none, gives the user's /model choice, then the caller's "
        "default, then the global default. A model the operator does not allow is a 400."))
    messages = serializers.ListField(child=docs.ChatMessageField(), allow_empty=False,
                                     help_text="Only the last user entry is read: the conversation is kept "
                                               "server-side.")
    stream = serializers.BooleanField(required=False, default=False,
                                      help_text="Answer as an SSE stream (text/event-stream).")
    conversation_id = conversation_id_field(required=False,
                                            help_text="The conversation; its first message creates the session.")
    client_message_id = serializers.CharField(required=False, max_length=255, help_text=(
        "Idempotency key: a repeat is answered from the message's receipt and runs nothing."))
    client_id = client_id_field(allow_blank=False,
                                help_text="Namespaces conversation ids, for several clients sharing one channel.")
    turn_id = serializers.RegexField(r"^[A-Za-z0-9._:-]{1,100}$", required=False,
                                     help_text="The turn's id, so another client can steer or stop exactly this turn.")
    include_thinking = serializers.BooleanField(required=False, default=False, help_text="Stream reasoning.")
    echo_user_message = serializers.BooleanField(required=False, default=False,
                                                 help_text="Echo the user's message (ugent_user_message).")
    ugent_allowed_tools = serializers.ListField(child=serializers.CharField(), required=False, help_text=(
        "Narrow this turn's tools. [] is refused rather than read as no restriction."))
    ugent_denied_tools = serializers.ListField(child=serializers.CharField(), required=False,
                                               help_text='Narrow this turn\'s tools; ["*"] runs it with none.')
    ugent_include_tool_events = serializers.BooleanField(required=False, default=False,
                                                         help_text='Stream tool executions as ugent_segment: "tool".')
    ugent_citation_ids = serializers.ListField(child=serializers.CharField(), required=False, default=list,
                                               help_text="Evidence ids the request supplied in its own prompt, "
                                                         "reported back when the answer cites them.")
    ugent_disable_memory_recall = serializers.BooleanField(required=False, default=False,
                                                           help_text="Recall no workspace memory into this turn.")
    ugent_disable_code_context = serializers.BooleanField(required=False, default=False,
                                                          help_text="Skip the pre-LLM code-context fetch.")
    ugent_disable_memory_write = serializers.BooleanField(required=False, default=False, help_text=(
        "Keep this turn out of memory: no extraction, no compaction summary, no memory_control tool."))
    ugent_input_mode = docs.InputModeField(required=False, allow_null=True)
    ugent_interaction_reply = docs.InteractionReplyField(required=False, help_text=(
        "Answers a waiting question by its id (Questions): submit with answers [{question_id, option_id}], or "
        "value for a text, secret or confirm question; or abort. Applied only to the question it names, only "
        "while it waits, only when it fits; never runs as a turn. Answered 200 with ugent.interaction_reply; "
        "refused 403 (someone else's conversation, as a turn into it), 404 (not the caller's question), 409 (it no longer waits) or 400 (it does not fit). With "
        "client_message_id an applied reply keeps a receipt, and a repeat is refused as DuplicateProcessed."))
    n = serializers.IntegerField(required=False, allow_null=True, help_text=(
        "OpenAI's number of choices: a turn gives one answer, so anything but 1 (or null) is a 400."))
    stream_options = serializers.DictField(required=False, allow_null=True, help_text=(
        "OpenAI's stream options: include_usage adds a last chunk with no choices that carries the usage."))

    def validate_n(self, value):
        if value not in (None, 1):
            raise serializers.ValidationError(ONE_CHOICE_ONLY)
        return value

    def validate_stream_options(self, value):
        if value is None:
            return {}
        for name in ("include_usage", "include_obfuscation"):  # OpenAI's; other keys are ignored, as at the top
            if name in value and not isinstance(value[name], bool):
                raise serializers.ValidationError(f"{name} must be true or false.")
        return value

    def validate_ugent_allowed_tools(self, value):
        if value == []:
            raise serializers.ValidationError(ALLOWED_TOOLS_EMPTY)
        return value

    def validate_ugent_input_mode(self, value):
        if value is not None and value not in INPUT_MODES:
            raise serializers.ValidationError(
                f"'{value}' is not an input mode: send \"voice\" or \"live\", or leave it out.")
        return value

    def validate_ugent_interaction_reply(self, value):
        return interaction_reply_clean(value)

    def validate_messages(self, value):
        entry = last_user_entry(value)
        if entry is None:
            raise serializers.ValidationError("it holds no user entry.")
        content = entry.get("content")
        if isinstance(content, list):
            if not content:
                raise serializers.ValidationError("the last user entry's content holds no parts.")
            for i, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    continue
                if file_part_id(part) is None:
                    raise serializers.ValidationError(NOT_A_TEXT_PART.format(i=i))
        elif not isinstance(content, str):
            raise serializers.ValidationError(CONTENT_SHAPE)
        problem = text_problem(last_user_text(value))
        if problem is not None:
            raise serializers.ValidationError(f"the message content {problem}")
        return value


REPLY_SHAPE = ('must be {"request_id": "<the question\'s id>", "action": "submit" or "abort", '
               '"answers": [{"question_id", "option_id"}] or "value": "…"}.')


def interaction_reply_clean(value) -> dict:
    """ugent_interaction_reply's shape (whether it fits its question is channels_app.questions' to say)."""
    if not isinstance(value, dict):
        raise serializers.ValidationError(REPLY_SHAPE)
    request_id, action = value.get("request_id"), value.get("action")
    if not isinstance(request_id, str) or not request_id.strip() or len(request_id) > 100:
        raise serializers.ValidationError("request_id must name the waiting question (its id from "
                                          "interaction.requested).")
    _reply_text("request_id", request_id)
    if action not in ("submit", "abort"):
        raise serializers.ValidationError('action must be "submit" or "abort".')
    out = {"request_id": request_id, "action": action}
    if action == "abort":
        return out
    answers, reply_value = value.get("answers"), value.get("value")
    if answers is not None:
        if not isinstance(answers, list) or not answers or not all(
                isinstance(a, dict) and isinstance(a.get("question_id"), str)
                and isinstance(a.get("option_id"), str) for a in answers):
            raise serializers.ValidationError("answers must be a non-empty list of "
                                              "{\"question_id\": \"…\", \"option_id\": \"…\"}.")
        for i, a in enumerate(answers):
            _reply_text("answers", a["question_id"], f"answer {i}'s question_id ")
            _reply_text("answers", a["option_id"], f"answer {i}'s option_id ")
        out["answers"] = [{"question_id": a["question_id"], "option_id": a["option_id"]} for a in answers]
    if reply_value is not None:
        if isinstance(reply_value, bool):  # a confirm answered with true/false
            reply_value = "yes" if reply_value else "no"
        if not isinstance(reply_value, str):
            raise serializers.ValidationError("value must be a string (or true/false for a confirm question).")
        _reply_text("value", reply_value)
        out["value"] = reply_value
    if "answers" not in out and "value" not in out:
        raise serializers.ValidationError('a submit carries answers (a choice or a form) or value (a text, '
                                          'secret or confirm question).')
    return out


def _reply_text(field: str, text: str, what: str = "") -> None:
    """The text a reply carries is stored and handed to the asking tool: refused as the message content is
    (bodies.text_problem), under ugent_interaction_reply.<field>, before anything is looked up or written."""
    problem = text_problem(text)
    if problem is not None:
        raise serializers.ValidationError({field: f"{what}{problem}"})


_serializers = threading.local()


def chat_input_validate(payload: dict) -> dict:
    """The request validated by ChatInputSerializer. One instance per thread validates every request:
    building a serializer deep-copies its 22 fields, a tenth of the request's time (py-spy)."""
    ser = getattr(_serializers, "chat", None)
    if ser is None:
        ser = _serializers.chat = ChatInputSerializer()
    try:
        return ser.run_validation(payload)
    except serializers.ValidationError as exc:
        raise from_drf(serializers.ValidationError(exc.detail))


def last_user_entry(messages: list) -> dict | None:
    """Only the last user entry is read: the conversation is kept server-side."""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return msg
    return None


def last_user_text(messages: list) -> str | None:
    """The text of the last user entry (validated by ChatInputSerializer: a string or text parts)."""
    entry = last_user_entry(messages)
    if entry is None:
        return None
    content = entry.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str))
    return None


FILE_LINK = re.compile(r"^(?:https?://[^/]+)?/v1/files/(" + files.FILE_ID.pattern + ")$")


def file_part_id(part) -> str | None:
    """The uploaded file a content part names (POST /v1/files), or None: OpenAI's file part
    {"type": "file", "file": {"file_id"}}, and input_audio or image_url naming the file by its id or link."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    body = part.get(kind) if kind in ("file", "input_audio", "image_url") else None
    if not isinstance(body, dict):
        return None
    file_id = body.get("file_id")
    if isinstance(file_id, str) and 0 < len(file_id) <= 64 and text_problem(file_id) is None:
        return file_id
    url = body.get("url")
    if kind == "image_url" and isinstance(url, str):
        m = FILE_LINK.match(url)
        return m.group(1) if m else None
    return None


def last_user_file_ids(messages: list) -> list[str]:
    """The uploaded files the last user entry's parts name, in order, each once."""
    entry = last_user_entry(messages)
    content = entry.get("content") if entry else None
    ids: list[str] = []
    if isinstance(content, list):
        for part in content:
            file_id = file_part_id(part)
            if file_id is not None and file_id not in ids:
                ids.append(file_id)
    return ids


#: What the chat view learns on its accept thread, for the request's log line (contextvars follow it there).
_request_note: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ugent_request_note", default=None)


def _accept(headers, payload: dict, loop=None):
    """Authenticate, validate and submit: (data, result, None, waiter), or (data, None, refusal, None)
    when the message itself was refused (a stream answers those in the stream). Raises for a bad key
    or body. With `loop`, a new turn's reader is subscribed on it before the turn's transaction
    commits (`waiter`), so it hears every event from the first and need not read them back."""
    close_old_connections()
    note = _request_note.get()
    principal = authenticate_headers(headers)
    if note is not None:
        note["principal"] = principal
    data = chat_input_validate(payload)
    if data.get("ugent_interaction_reply") is not None:
        try:
            return data, _reply(principal, data), None, None
        except ApplicationError as exc:
            return data, None, exc, None
    waiters = []

    def subscribe(turn):
        if loop is not None:
            waiters.append(notify.register(turn_topic(turn.pk), loop))

    try:
        result = _submit(principal, data, on_turn=subscribe)
        if note is not None:
            note["actor"] = result.turn.actor.key
        return data, result, None, (waiters[0] if waiters else None)
    except ApplicationError as exc:
        for waiter in waiters:
            waiter.close()
        return data, None, exc, None
    except BaseException:
        for waiter in waiters:
            waiter.close()
        raise


def _close_accepted_waiter(accepting: asyncio.Future) -> None:
    waiter = None if accepting.cancelled() or accepting.exception() else accepting.result()[3]
    if waiter is not None:
        waiter.close()


def _mark_accepted(request, turn_id: str, conversation_id: str) -> None:
    """Accepted: any answer from here on must not invite a resend, and names the turn and its conversation
    (ugent_site.api_handler reads the mark)."""
    if hasattr(request, "scope"):  # an ASGI request (the test client's WSGI request has no scope)
        request.scope[services.ACCEPTED_TURN_SCOPE_KEY] = (turn_id, conversation_id)


async def _accept_settled(accepting: asyncio.Future, request) -> None:
    """The request was cancelled (the client left, the server stops) while its message was being accepted:
    wait for the accept to end on its thread (each of its writes is bounded by the database's busy timeout)
    and, if it took the message, mark the request accepted, so the answer to the cancel says not to resend.
    The turn's waiter must not outlive this request."""
    accepting.add_done_callback(_close_accepted_waiter)
    while not accepting.done():
        try:
            await asyncio.wait([accepting])
        except asyncio.CancelledError:  # asyncio.run cancels every task again once the server has stopped
            continue
    if accepting.cancelled() or accepting.exception() is not None:
        return
    _data, result, refused, _waiter = accepting.result()
    if refused is None and not isinstance(result, dict):  # a turn, not a question reply
        _mark_accepted(request, result.turn.turn_id, result.conversation.external_id)


def _submit(principal, data: dict, on_turn=None):
    actor = services.actor_named_of_request(principal, data)
    inbound = services.Submission(
        actor=actor, caller=principal.caller, api_key_id=principal.key_id,
        text=last_user_text(data["messages"]), channel="web",
        client_id=data.get("client_id") or "", conversation_id=data.get("conversation_id"),
        client_message_id=data.get("client_message_id"), turn_id=data.get("turn_id"),
        model=data.get("model"), input_mode=data.get("ugent_input_mode"),
        allowed_tools=data.get("ugent_allowed_tools"), denied_tools=data.get("ugent_denied_tools"),
        disable_memory_recall=data["ugent_disable_memory_recall"],
        disable_code_context=data["ugent_disable_code_context"],
        disable_memory_write=data["ugent_disable_memory_write"],
        include_thinking=data["include_thinking"], citation_ids=data.get("ugent_citation_ids") or [],
        file_ids=last_user_file_ids(data["messages"]), answer_whole=not data["stream"])
    return services.message_submit(inbound=inbound, on_turn=on_turn)


def _reply(principal, data: dict) -> dict:
    """A question reply: applied to the question it names, for the user it asked; never a turn."""
    actor = services.actor_existing_of_request(principal, data)
    conversation = None
    if data.get("conversation_id"):
        # someone else's conversation is the seed's 403, as a turn into it is ("A turn, a question reply or a file
        # on someone else's conversation is refused"); one that does not exist holds no question of theirs
        conversation = services.conversation_writable_or_new(
            actor=actor, conversation_id=data["conversation_id"], client_id=data.get("client_id") or "")
    if actor is None or (data.get("conversation_id") and conversation is None):
        # an actor with no row was asked nothing: the 404 of a question that is not theirs, and no row written
        raise ApplicationError(questions.NO_SUCH_QUESTION, status=404, code="question_not_found",
                               param="ugent_interaction_reply.request_id")
    return services.question_reply_submit(actor=actor, reply=data["ugent_interaction_reply"],
                                          conversation=conversation, content=last_user_text(data["messages"]) or "",
                                          client_message_id=data.get("client_message_id"))


def _reply_response(reply: dict, stream: bool, model: str):
    """A reply's answer: the JSON object, or for a stream that object as one named event, then [DONE]; with the
    x-ugent-conversation-id header as every answer to a chat request that names a conversation."""
    if not stream:
        resp = JsonResponse(reply)
        resp["x-ugent-conversation-id"] = reply["conversation_id"]
        return resp
    renderer = ChunkRenderer(turn_id=reply["turn_id"], model=model or "ugent-default", created=int(time.time()))

    async def body():
        yield renderer.named("ugent.interaction_reply", "ugent_interaction_reply", reply)
        yield DONE
    resp = _sse_response(body(), None)
    resp["x-ugent-conversation-id"] = reply["conversation_id"]
    return resp


def _queued_receipt(result) -> dict:
    """The receipt of a message accepted while the broker was down, from what the accept already holds."""
    return {"conversation_id": result.conversation.external_id,
            "client_message_id": result.receipt.client_message_id, "state": "accepted",
            "turn_id": result.turn.turn_id, "queued": True}


def _events_after(turn_pk: int, cursor: int) -> list[tuple[int, str, dict]]:
    close_old_connections()
    return statements.turn_events_after(turn_pk, cursor)


def _take_pushed(batches: list, cursor: int) -> list | None:
    """The rows the wake-ups carried that follow `cursor` without a gap; None when the database must be read
    (a plain wake-up, or a batch that does not start where the reader stands)."""
    if not batches:
        return None
    return notify.rows_following(batches, cursor, lambda row: row[0])


async def turn_events(turn_pk: int, waiter: notify.Waiter | None = None):
    """Yield a turn's events in cursor order until its terminal event; None on idle keep-alive ticks.

    `waiter`: one subscribed before the turn's first event could commit, so the events arrive with
    their wake-ups and the first read of the database is skipped (any gap still reads it)."""
    read = sync_to_async(_events_after, thread_sensitive=False)
    cursor, idle_since = 0, time.monotonic()
    try:
        if waiter is None:
            waiter = await notify.subscribe(turn_topic(turn_pk))
            rows = await read(turn_pk, cursor)
        else:
            rows = []
        while True:
            for row in rows:
                cursor = row[0]
                yield row
                if row[1] in TERMINAL:
                    return
            if rows:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= settings.UGENT_SSE_KEEPALIVE:
                idle_since = time.monotonic()
                yield None
            await waiter.wait()
            rows = _take_pushed(waiter.take(), cursor)
            if rows is None:
                rows = await read(turn_pk, cursor)
    finally:
        waiter.close()


def _sse_response(body, turn_id: str | None, conversation_id: str | None = None) -> StreamingHttpResponse:
    resp = StreamingHttpResponse(body, content_type="text/event-stream; charset=utf-8")
    resp["Cache-Control"] = "no-cache"
    resp["X-Accel-Buffering"] = "no"
    if turn_id:
        _name_the_turn(resp, turn_id, conversation_id)
    return resp


def _name_the_turn(resp, turn_id: str, conversation_id: str | None) -> None:
    """The headers that name an accepted message's turn and its conversation: a request that named no
    conversation_id started one, and this is where its client learns the id to send its next message under."""
    resp["x-ugent-turn-id"] = turn_id
    if conversation_id:
        resp["x-ugent-conversation-id"] = conversation_id


def _refusal_stream(exc: ApplicationError, model: str):
    """A refusal after the request was read, inside a stream: the receipt first where there is one."""
    turn_id = exc.extra.get("turn_id") if isinstance(exc.extra, dict) else None
    renderer = ChunkRenderer(turn_id=turn_id or "refused", model=model or "ugent-default",
                             created=int(time.time()))

    async def body():
        receipt = exc.extra.get("receipt") if isinstance(exc.extra, dict) else None
        if receipt:
            yield renderer.named("ugent.receipt", "ugent_receipt", receipt)
        extra = {k: v for k, v in exc.extra.items() if k != "receipt"}
        yield renderer.error(exc.message, code=exc.code, type_=exc.body()["error"]["type"], param=exc.param,
                             extra=extra)
        yield DONE

    resp = _sse_response(body(), turn_id)
    for k, v in exc.headers.items():
        resp[k] = v
    return resp


class ChatCompletionApi(View):
    """POST /v1/chat/completions: OpenAI-compatible chat, stream and non-stream, with UGENT's extensions."""

    @extend_schema(operation_id="chat_completions_create", tags=["chat"], summary="Chat (stream and non-stream)",
                   description=("OpenAI-compatible chat with the UGENT extensions. The x-ugent-turn-id response "
                                "header names the turn, and x-ugent-conversation-id its conversation (the one a "
                                "request without conversation_id started). A repeated client_message_id runs nothing: 409 "
                                "(DuplicateInFlight, DuplicateProcessed) without streaming."),
                   request={"application/json": ChatInputSerializer}, examples=docs.CHAT_EXAMPLES,
                   responses=docs.chat_responses())
    async def post(self, request):
        note: dict = {}
        _request_note.set(note)
        try:
            return await self._post(request)
        finally:  # for the request's log line (ugent_site.middleware)
            if "principal" in note:
                request.user = note["principal"]
            request.ugent_actor = note.get("actor")

    async def _post(self, request):
        try:
            payload = json_object_parse(request_body(request))
            # One hop to a worker thread for the key, the checks and the message: a plain future, not a
            # task, as a server's shutdown cancels every task and the accept's outcome must outlive that.
            loop = asyncio.get_running_loop()
            accepting = loop.run_in_executor(None, contextvars.copy_context().run, _accept,
                                             request.headers, payload, loop)
            try:
                data, result, refused, waiter = await asyncio.shield(accepting)
            except asyncio.CancelledError:
                await _accept_settled(accepting, request)
                raise
        except ApplicationError as exc:
            return error_response(exc)
        stream = data["stream"]
        if refused is not None:
            if stream and refused.status in (403, 409):
                return _refusal_stream(refused, data.get("model") or "")
            return error_response(refused)
        if isinstance(result, dict):  # a question reply: no turn ran
            return _reply_response(result, stream, data.get("model") or "")
        turn = result.turn
        _mark_accepted(request, turn.turn_id, result.conversation.external_id)
        renderer = ChunkRenderer(turn_id=turn.turn_id, model=turn.model or (data.get("model") or ""),
                                 created=int(time.time()),
                                 include_tool_events=data["ugent_include_tool_events"],
                                 include_usage=stream and bool((data.get("stream_options") or {})
                                                               .get("include_usage")))
        # The broker could not take the turn: it is accepted and waits in its row (docs/turns.md).
        queued = _queued_receipt(result) if result.queued else None
        if queued is not None and not stream:
            if waiter is not None:
                waiter.close()
            resp = JsonResponse({"object": "ugent.receipt", "ugent_receipt": queued, "ugent_turn_id": turn.turn_id,
                                 "ugent_conversation_id": result.conversation.external_id}, status=202)
            _name_the_turn(resp, turn.turn_id, result.conversation.external_id)
            return resp
        if stream:
            resp = _sse_response(self._stream(turn.pk, renderer, waiter, queued), turn.turn_id,
                                 result.conversation.external_id)
            if waiter is not None:  # a stream whose body never starts (the client left) still lets go
                resp._resource_closers.append(waiter.close)
            return resp
        return await self._complete(turn, result.conversation.external_id, renderer, data, waiter)

    async def _stream(self, turn_pk: int, renderer: ChunkRenderer, waiter=None, queued=None):
        if queued is not None:
            yield renderer.named("ugent.receipt", "ugent_receipt", queued)
        async for row in turn_events(turn_pk, waiter):
            if row is None:
                yield PING
                continue
            out = renderer.render(row[1], row[2])
            if out:
                yield out

    async def _complete(self, turn: Turn, conversation_id: str, renderer: ChunkRenderer, data: dict, waiter=None):
        answer, thinking, citations, user_message, final = [], [], [], None, None
        artifacts: list = []
        async for row in turn_events(turn.pk, waiter):
            if row is None:
                continue
            _cursor, etype, edata = row
            if etype == "turn.delta":
                seg = edata.get("segment")
                if seg == "answer":
                    answer.append(edata.get("text", ""))
                elif seg == "answer_reset":
                    answer.clear()
                elif seg == "thinking":
                    thinking.append(edata.get("text", ""))
            elif etype == "ugent.user_message":
                user_message = edata
            elif etype == "ugent.citations":
                citations = edata.get("citations", [])
            elif etype in ("ugent.artifacts", "ugent.artifacts_pending"):
                # announced pending, then finished: each artifact once, as it last stood
                for a in edata.get("artifacts", []):
                    at = next((i for i, b in enumerate(artifacts)
                               if a.get("artifact_id") and b.get("artifact_id") == a.get("artifact_id")), None)
                    if at is None:
                        artifacts.append(a)
                    else:
                        artifacts[at] = a
            elif etype in TERMINAL:
                final = (etype, edata)
        etype, edata = final
        if etype == "turn.failed":
            # It failed after it was accepted and may already have acted: the client must not send it again.
            return error_response(ApplicationError(
                edata.get("reason", "The turn failed."), status=502, code=edata.get("code") or "turn_failed",
                extra={"turn_id": turn.turn_id, "conversation_id": conversation_id},
                headers=services.accepted_turn_headers(turn.turn_id, conversation_id)))
        message = {"role": "assistant", "content": "".join(answer), "refusal": None}
        if data["include_thinking"] and thinking:
            message["reasoning_content"] = "".join(thinking)
        body = {"id": renderer.id, "object": "chat.completion", "created": renderer.created,
                "model": renderer.model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
                "usage": usage_or_zero(edata.get("usage")),
                "ugent_turn_id": turn.turn_id, "ugent_conversation_id": conversation_id, "ugent_citations": citations}
        if artifacts:
            body["ugent_artifacts"] = artifacts
        if etype == "turn.cancelled":
            body["ugent_stopped"] = True
        if data["echo_user_message"] and user_message:
            body["ugent_user_message"] = user_message
        resp = JsonResponse(body)
        _name_the_turn(resp, turn.turn_id, conversation_id)
        return resp


class ModelsListApi(APIView):
    """GET /v1/models: the models a caller may name."""

    @extend_schema(operation_id="models_list", tags=["chat"], summary="The models a caller may name",
                   responses={200: docs.ModelsListSerializer, **docs.errors(401, 403)})
    def get(self, request):
        return Response({"object": "list", "data": models_list()})


NO_SUCH_MODEL = "The model '{model}' does not exist or you do not have access to it."


class ModelGetApi(APIView):
    """GET /v1/models/{model}: one model GET /v1/models lists (OpenAI's retrieveModel)."""

    @extend_schema(operation_id="models_retrieve", tags=["chat"], summary="One model a caller may name",
                   description="The model object GET /v1/models lists under this id (ugent-default too); "
                               "404 model_not_found, an invalid_request_error, for any other, as OpenAI answers.",
                   responses={200: docs.ModelSerializer, **docs.errors(401, 403, 404)})
    def get(self, request, model: str):
        found = model_get(model)
        if found is None:
            # typed as OpenAI types it (an invalid_request_error, not UGENT's not_found_error): this is
            # OpenAI's own endpoint, and a client written against OpenAI reads the type
            raise ApplicationError(NO_SUCH_MODEL.format(model=model), status=404, code="model_not_found",
                                   param="model", type_="invalid_request_error")
        return Response(found)


class HealthApi(APIView):
    """GET /v1/health: worker health. Needs no key and says nothing about anyone's data."""

    authentication_classes = []
    permission_classes = []

    @extend_schema(operation_id="health", tags=["host"], summary="Worker health (no key)",
                   description="503 \"database_unavailable\" when the database does not answer; 503 \"warming\" in servers mode until a worker has warmed its engines "
                               "(at most UGENT_WARM_WAIT_SECS after the first ask), so the first turn is fast.",
                   responses={200: docs.HealthSerializer, 503: docs.HealthSerializer})
    def get(self, request):
        from django.db import InterfaceError, OperationalError
        try:
            statements.database_ping()
        except (OperationalError, InterfaceError) as exc:  # the database is away: unhealthy, not a 500
            log.warning("health: the database is unavailable: %s", str(exc).strip().splitlines()[0] if str(exc).strip()
                        else type(exc).__name__)
            return Response({"status": "database_unavailable", "mode": settings.UGENT_MODE}, status=503)
        if not workers_warm():
            return Response({"status": "warming", "mode": settings.UGENT_MODE}, status=503)
        return Response({"status": "ok", "mode": settings.UGENT_MODE})


class ReceiptGetApi(APIView):
    """GET /v1/ugent/receipt: where one message stands, for its sender and the operator (channels_app.access)."""

    class InputSerializer(IdentityFields):
        conversation_id = conversation_id_field()
        client_message_id = serializers.CharField(max_length=255)
        client_id = client_id_field()

    @extend_schema(operation_id="receipt_get", tags=["recovery"], summary="Where one message stands",
                   description="Only its sender and the operator see it; to anyone else it is a 404, as a "
                               "missing message is.",
                   parameters=[InputSerializer], responses={200: docs.ReceiptSerializer, **docs.errors(400, 401, 403, 404)})
    def get(self, request):
        ser = self.InputSerializer(data=request.query_params)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = services.reader_of_request(request.user, d)
        return Response(services.receipt_get(viewer=viewer, conversation_id=d["conversation_id"],
                                             client_message_id=d["client_message_id"],
                                             client_id=d.get("client_id", "")))


class StatusApi(APIView):
    """GET /v1/ugent/status: host status, operator keys only."""

    permission_classes = [IsOperator]

    @extend_schema(operation_id="status", tags=["host"], summary="Host status (operator keys only)",
                   responses={200: docs.StatusSerializer, **docs.errors(401, 403)})
    def get(self, request):
        from channels_app.status import status_report
        return Response(status_report())
