"""The Web Channel API described for OpenAPI (drf-spectacular): shapes, security, and the async views.

Served at GET /v1/openapi.json with a Swagger UI at /v1/docs (ugent_site/urls.py). The views in
api.py and api_streams.py carry their own `extend_schema`; this module holds what they share:

- the response shapes (serializers used for documentation only: the views build plain dicts);
- the API key security schemes (x-api-key, or Authorization: Bearer);
- a schema generator that also reads the hub's async Django views (chat completions and the two
  SSE streams), which DRF's enumerator skips because they are not DRF views;
- the chat stream's and the event streams' SSE shapes, one schema per event as OpenAPI 3.0 has
  `schema` describe each event of a text/event-stream (schemathesis validates them so).

Imports nothing of the hub but its constants: the views import this, never the other way round.
"""
from __future__ import annotations

from drf_spectacular import generators
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema_field, inline_serializer
from rest_framework import serializers
from rest_framework.views import APIView

from channels_app.models import INPUT_MODES

RECEIPT_STATES = ["accepted", "running", "completed", "cancelled", "refused", "failed", "interrupted",
                  "abandoned"]
SEGMENTS = ["answer", "thinking", "tool", "error", "answer_reset"]
CHAT_NAMED_EVENTS = ["ugent.user_message", "ugent.citations", "ugent.artifacts", "ugent.artifacts_pending",
                     "ugent.receipt"]


# --- security ------------------------------------------------------------------------------------

class ApiKeyScheme(OpenApiAuthenticationExtension):
    """Every request carries its key as x-api-key or Authorization: Bearer (either one)."""

    target_class = "channels_app.auth.ApiKeyAuthentication"
    name = ["ApiKeyHeader", "BearerKey"]

    def get_security_requirement(self, auto_schema):
        return [{"ApiKeyHeader": []}, {"BearerKey": []}]  # either one, not both

    def get_security_definition(self, auto_schema):
        return [
            {"type": "apiKey", "in": "header", "name": "x-api-key",
             "description": "The caller's API key. UGENT_WEB_API_KEY is an operator key."},
            {"type": "http", "scheme": "bearer", "description": "The same key as Authorization: Bearer <key>."},
        ]


# --- errors --------------------------------------------------------------------------------------

class ErrorObjectSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField(help_text="invalid_request_error, authentication_error, permission_error, "
                                           "not_found_error, conflict_error, api_error, … (by the status; "
                                           "GET /v1/models/{model}'s 404 is OpenAI's invalid_request_error)")
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    """OpenAI's error object. A refusal may carry more fields beside these (turn_id, state, receipt; a
    non-stream 502 carries turn_id and conversation_id, the turn and its conversation)."""

    error = ErrorObjectSerializer()


def errors(*statuses: int) -> dict:
    """The error responses an operation documents, each the OpenAI-style error object."""
    words = {400: "Bad input: the spec's wording in error.message; nothing changed.",
             401: "A missing or unknown API key.",
             403: ("Refused by a rule of Keys and callers: not this caller's or this user's to read or act on, "
                   "or an identity token that fails verification (docs/identity.md)."),
             404: "Nothing of that name that this caller may see.",
             409: ("A conflict: a repeated client_message_id, a turn_id a turn already holds (anyone's: the same "
                   "answer), a turn that already finished, no running turn."),
             502: ("The turn failed upstream after it started (non-stream). It carries x-should-retry: false: "
                   "the turn may already have acted, so send it again only as a new message. Its error object "
                   "names the turn (turn_id) and its conversation (conversation_id), as the x-ugent-turn-id and "
                   "x-ugent-conversation-id headers do. Or, for a question reply, the option matcher or the "
                   "yes/no engine failed reading it (reply_reader_failed): nothing was applied, the question "
                   "keeps waiting, and it may be sent again."),
             503: "Not available here: nothing installed can do it (GET /v1/ugent/status says so first)."}
    return {s: OpenApiResponse(ErrorSerializer, description=words[s]) for s in statuses}


# --- chat request fields -------------------------------------------------------------------------

_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_FILE_PART = {"type": "object", "required": ["type", "file"], "properties": {
    "type": {"type": "string", "enum": ["file"]},
    "file": {"type": "object", "required": ["file_id"], "properties": {"file_id": {"type": "string"}}}},
    "description": "An uploaded file of the same conversation and user (POST /v1/files); input_audio and "
                   "image_url parts may name one too, by file_id (image_url also by its /v1/files/<id> url)."}


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [_TEXT_PART, _FILE_PART]}}],
                      "description": 'A string, or a list of text parts ([{"type": "text", "text": "…"}]) and '
                                     'file parts ([{"type": "file", "file": {"file_id": "…"}}]).'})
class _ContentField(serializers.Field):
    pass


class ChatMessageSerializer(serializers.Serializer):
    """An OpenAI chat message. Only the last `user` entry is read: the conversation is kept server-side."""

    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant", "tool"])
    content = _ContentField()
    name = serializers.CharField(required=False)


@extend_schema_field(ChatMessageSerializer)
class ChatMessageField(serializers.DictField):
    """One entry of `messages`: a dict, validated by ChatInputSerializer.validate_messages."""


class InteractionAnswerSerializer(serializers.Serializer):
    question_id = serializers.CharField()
    option_id = serializers.CharField(required=False)
    value = serializers.CharField(required=False)


class InteractionReplySerializer(serializers.Serializer):
    request_id = serializers.CharField(help_text="The waiting question's id (interaction.requested).")
    action = serializers.ChoiceField(choices=["submit", "abort"])
    answers = InteractionAnswerSerializer(many=True, required=False)
    value = serializers.CharField(required=False, help_text="Answers a text, secret or confirm question.")


@extend_schema_field(InteractionReplySerializer)
class InteractionReplyField(serializers.DictField):
    """ugent_interaction_reply: answers a waiting question by its id (Questions)."""


@extend_schema_field({"type": "string", "enum": list(INPUT_MODES), "nullable": True,
                      "description": '"voice" for a voice message, "live" for a turn a call hands over; '
                                     "any other value is a 400."})
class InputModeField(serializers.CharField):
    pass


# --- chat responses ------------------------------------------------------------------------------

class UsageSerializer(serializers.Serializer):
    """OpenAI's usage: from the upstream where it reports it, counted otherwise."""

    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class AssistantMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["assistant"])
    content = serializers.CharField(allow_blank=True)
    refusal = serializers.CharField(allow_null=True)
    reasoning_content = serializers.CharField(required=False, help_text="With include_thinking: the reasoning.")


class ChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessageSerializer()
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = serializers.JSONField(allow_null=True)


class UserMessageSerializer(serializers.Serializer):
    """The user's message as the conversation keeps it (ugent.user_message)."""

    class Meta:
        ref_name = "UgentUserMessage"

    content = serializers.CharField(required=False, allow_blank=True)
    recordings = serializers.ListField(child=serializers.DictField(), required=False,
                                       help_text="Each recording with what was heard (transcript, duration_ms).")


class ChatCompletionSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["chat.completion"])
    created = serializers.IntegerField()
    model = serializers.CharField(allow_blank=True)
    choices = ChoiceSerializer(many=True)
    usage = UsageSerializer(required=False)
    ugent_turn_id = serializers.CharField(help_text="The turn's id (also the x-ugent-turn-id header).")
    ugent_conversation_id = serializers.CharField(help_text=(
        "The turn's conversation (also the x-ugent-conversation-id header): the one a request without "
        "conversation_id started, to send the next message under."))
    ugent_citations = serializers.ListField(child=serializers.CharField(),
                                            help_text="The verified citation ids the answer used.")
    ugent_stopped = serializers.BooleanField(required=False, help_text="The turn was stopped: the answer so far.")
    ugent_user_message = UserMessageSerializer(required=False, help_text="With echo_user_message.")


class ReceiptSerializer(serializers.Serializer):
    """Where one message stands. answer, citations and files once completed; reason once it ended otherwise."""

    conversation_id = serializers.CharField()
    client_message_id = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=RECEIPT_STATES)
    turn_id = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField(allow_null=True, required=False)
    started_at = serializers.DateTimeField(allow_null=True, required=False)
    finished_at = serializers.DateTimeField(allow_null=True, required=False)
    answer = serializers.CharField(required=False, allow_blank=True)
    citations = serializers.ListField(child=serializers.CharField(), required=False)
    files = serializers.ListField(child=serializers.JSONField(), required=False)
    reason = serializers.CharField(required=False, allow_blank=True)
    queued = serializers.BooleanField(required=False, help_text="Accepted while the broker was down: it waits.")


class QueuedReceiptSerializer(serializers.Serializer):
    """202: the message is accepted and its turn waits for a worker (the broker could not take it)."""

    object = serializers.ChoiceField(choices=["ugent.receipt"])
    ugent_receipt = ReceiptSerializer()
    ugent_turn_id = serializers.CharField()
    ugent_conversation_id = serializers.CharField()


TURN_ID_HEADER = {"x-ugent-turn-id": {"schema": {"type": "string"}, "description": "The turn's id."},
                  "x-ugent-conversation-id": {"schema": {"type": "string"}, "description": "The turn's conversation."}}


def chat_responses() -> dict:
    stream_text = ("With stream: true. OpenAI chunks (data:), each delta tagged with ugent_segment (answer, "
                   "thinking, tool, error, answer_reset), ending in data: [DONE]; the rest comes as named "
                   "events (" + ", ".join(CHAT_NAMED_EVENTS) + "). A refusal ends the stream at once with an "
                   "error chunk, after ugent.receipt where there is one. Keep-alives are comment lines.")
    return {
        (200, "application/json"): OpenApiResponse(ChatCompletionSerializer, description="The answer (stream: false)."),
        (200, "text/event-stream"): OpenApiResponse({"$ref": "#/components/schemas/ChatStreamEvent"},
                                                    description=stream_text),
        (202, "application/json"): OpenApiResponse(QueuedReceiptSerializer, description=QueuedReceiptSerializer.__doc__),
        **errors(400, 401, 403, 404, 409, 502),
    }


# --- the other endpoints' shapes -----------------------------------------------------------------

class ModelSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="A model name, or <provider>:<instance>@<model> where two share one.")
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField()
    owned_by = serializers.CharField()


ModelsListSerializer = inline_serializer("ModelsList", {
    "object": serializers.ChoiceField(choices=["list"]), "data": ModelSerializer(many=True)})

HealthSerializer = inline_serializer("Health", {
    "status": serializers.ChoiceField(choices=["ok", "warming", "database_unavailable"]),
    "mode": serializers.ChoiceField(choices=["embedded", "servers"])})


class VoiceCapabilitySerializer(serializers.Serializer):
    available = serializers.BooleanField()
    reason = serializers.ChoiceField(choices=["disabled", "classification", "no_engine"], required=False)


class VoiceInputSerializer(VoiceCapabilitySerializer):
    transcription = serializers.BooleanField()
    dictation = serializers.BooleanField()
    native_models = serializers.ListField(child=serializers.CharField())


class VoiceSerializer(serializers.Serializer):
    input = VoiceInputSerializer()
    output = VoiceCapabilitySerializer()
    live = VoiceCapabilitySerializer()


class StatusBodySerializer(serializers.Serializer):
    """What the daemon reports; each room adds its own section (rules, plugins, cron, …) beside these."""

    mode = serializers.ChoiceField(choices=["embedded", "servers"])
    media = inline_serializer("StatusMedia", {"voice": VoiceSerializer()})
    rules = serializers.DictField(required=False)
    plugins = serializers.DictField(required=False)
    cron = serializers.DictField(required=False)


StatusSerializer = inline_serializer("Status", {"status": StatusBodySerializer()})

StopSerializer = inline_serializer("StopAccepted", {
    "object": serializers.ChoiceField(choices=["ugent.stop"]), "conversation_id": serializers.CharField(),
    "turn_id": serializers.CharField(), "state": serializers.ChoiceField(choices=["stopping"]),
    "already_requested": serializers.BooleanField()})

SteeringSerializer = inline_serializer("SteeringAccepted", {
    "object": serializers.ChoiceField(choices=["ugent.steering"]), "id": serializers.IntegerField(),
    "conversation_id": serializers.CharField(), "turn_id": serializers.CharField(),
    "state": serializers.CharField(),
    "duplicate": serializers.BooleanField(required=False, help_text=(
        "true: a resend under a client_message_id already used with these words; the first steering, "
        "nothing steered again."))})

CommandResultSerializer = inline_serializer("CommandResult", {
    "object": serializers.ChoiceField(choices=["ugent.command"]),
    "command": serializers.CharField(help_text='The command\'s name as read, e.g. "/model".'),
    "ok": serializers.BooleanField(help_text="False: unsupported, or the engine could not answer (/btw)."),
    "unsupported": serializers.BooleanField(help_text="True: not a command here; text lists the supported ones."),
    "changed": serializers.BooleanField(help_text="Something was stored (/model, /harness edits, /steering)."),
    "text": serializers.CharField(allow_blank=True, help_text="The answer in words, for a chat channel."),
    "data": serializers.DictField(help_text="The answer as data; its fields depend on the command (docs/commands.md)."),
    "conversation_id": serializers.CharField(allow_null=True)})


class WorkingDirectorySerializer(serializers.Serializer):
    conversation_id = serializers.CharField()
    client_id = serializers.CharField(allow_blank=True)
    channel = serializers.CharField()
    directory = serializers.CharField(help_text='Relative to the workspace root; "." is the root.')
    path = serializers.CharField(help_text=("The absolute path on the host for an operator key; in the /sandbox "
                                            "command's report (POST /v1/ugent/commands) to anyone else, relative "
                                            "to the workspace root like directory."))


SandboxSerializer = inline_serializer("Sandbox", {
    "object": serializers.ChoiceField(choices=["ugent.sandbox"]),
    "workspace_root": serializers.CharField(
        allow_null=True, help_text=("The workspace's path on the host, for an operator key; null in the /sandbox "
                                    "command's report (POST /v1/ugent/commands, its data) to anyone else, whose "
                                    "paths are all relative to the workspace root.")),
    "workspace_exists": serializers.BooleanField(),
    "writable_paths": serializers.ListField(child=serializers.CharField(),
                                            help_text=("UGENT_SANDBOX_WRITABLE; empty: tools write nothing. Host "
                                                       "paths for an operator key; for anyone else relative to the "
                                                       "workspace root (\".\" the root, \"(outside the "
                                                       "workspace)\" one beyond it).")),
    "network": serializers.BooleanField(help_text="UGENT_SANDBOX_NETWORK."),
    "working_directory": WorkingDirectorySerializer(allow_null=True,
                                                    help_text="The conversation asked about, or null."),
    "working_directories": WorkingDirectorySerializer(many=True, required=False,
                                                      help_text="Every conversation with one set.")})

DirectorySerializer = inline_serializer("Directory", {
    "object": serializers.ChoiceField(choices=["ugent.directory"]),
    "conversation_id": serializers.CharField(), "client_id": serializers.CharField(allow_blank=True),
    "channel": serializers.CharField(), "directory": serializers.CharField(), "path": serializers.CharField()})


class RepairFixSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=["turn_ended_in_log", "lease_lapsed", "queue_deadline_passed",
                                            "receipt_behind_turn", "receipt_without_turn"])
    turn_id = serializers.CharField(allow_null=True)
    client_message_id = serializers.CharField(allow_null=True)
    to = serializers.CharField()


RepairFixSerializer._declared_fields["from"] = serializers.CharField()  # a keyword in Python

RepairSerializer = inline_serializer("Repair", {
    "object": serializers.ChoiceField(choices=["ugent.repair"]),
    "conversation_id": serializers.CharField(), "client_id": serializers.CharField(allow_blank=True),
    "channel": serializers.CharField(), "fixed": RepairFixSerializer(many=True),
    "fixed_count": serializers.IntegerField()})


class MessageSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    role = serializers.CharField()
    content = serializers.CharField(allow_blank=True)
    turn_id = serializers.CharField(allow_null=True)
    actor = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField(allow_null=True)


ConversationSnapshotSerializer = inline_serializer("ConversationSnapshot", {
    "object": serializers.ChoiceField(choices=["ugent.conversation.snapshot"]),
    "conversation_id": serializers.CharField(), "client_id": serializers.CharField(allow_blank=True),
    "channel": serializers.CharField(),
    "as_of": serializers.DateTimeField(help_text="The daemon's clock, to measure a question's deadline against."),
    "cursor": serializers.IntegerField(help_text="The event cursor the snapshot was read at."),
    "receipts": ReceiptSerializer(many=True, help_text="The 50 newest receipts, each only its sender's."),
    "question": serializers.DictField(allow_null=True, help_text="The question waiting, for the user it asked."),
    "verifications": serializers.ListField(child=serializers.DictField())})

SessionSnapshotSerializer = inline_serializer("SessionSnapshot", {
    "object": serializers.ChoiceField(choices=["ugent.snapshot"]),
    "conversation_id": serializers.CharField(), "client_id": serializers.CharField(allow_blank=True),
    "as_of": serializers.DateTimeField(), "cursor": serializers.IntegerField(),
    "messages": MessageSerializer(many=True), "has_older": serializers.BooleanField(),
    "hidden_count": serializers.IntegerField()})

SessionHistorySerializer = inline_serializer("SessionHistory", {
    "object": serializers.ChoiceField(choices=["list"]), "conversation_id": serializers.CharField(),
    "data": MessageSerializer(many=True), "has_more": serializers.BooleanField(),
    "next_before": serializers.IntegerField(allow_null=True, help_text="Send as `before` for the next page.")})


def event_stream_responses(what: str) -> dict:
    text = (f"{what} Each event's SSE id is a durable cursor: send the last one back as Last-Event-ID (or "
            "?cursor=) and the stream goes on after it. A position the log no longer holds is answered with "
            "one ugent.gap event (reason pruned, other_store or unknown) carrying the conversation's snapshot. "
            "Keep-alives are comment lines. The stream does not end by itself.")
    return {(200, "text/event-stream"): OpenApiResponse({"$ref": "#/components/schemas/LogStreamEvent"},
                                                        description=text),
            **errors(400, 401, 403, 404)}


# --- the SSE events, one schema per event ---------------------------------------------------------

def _sse(event: dict, data: dict, description: str) -> dict:
    return {"type": "object", "description": description, "required": ["event", "data"],
            "properties": {"event": event, "data": data, "id": {"type": "string"},
                           "retry": {"type": "integer"}}}


STREAM_COMPONENTS = {
    "ChatCompletionChunk": {
        "type": "object", "description": "One data: line of the chat stream (JSON).",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion.chunk"]},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"},
                "delta": {"type": "object", "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {"type": "string", "nullable": True},
                    "reasoning_content": {"type": "string", "description": "ugent_segment thinking."},
                    "ugent_segment": {"type": "string", "enum": SEGMENTS,
                                      "description": "answer_reset withdraws every answer chunk since the last "
                                                     "reset."},
                    "ugent_tool": {"type": "object", "description": "ugent_segment tool, with "
                                                                    "ugent_include_tool_events."}}},
                "finish_reason": {"type": "string", "nullable": True}}}},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "ugent_stopped": {"type": "boolean"},
            "ugent_user_message": {"$ref": "#/components/schemas/UgentUserMessage"},
            "ugent_citations": {"type": "array", "items": {"type": "string"}},
            # {artifact_id, id, name, mime, bytes, url, expires_at}, or {…, error} (channels_app.artifacts)
            "ugent_artifacts": {"type": "array", "items": {"type": "object"}},
            "ugent_artifacts_pending": {"type": "array", "items": {"type": "object"}},
            "ugent_receipt": {"$ref": "#/components/schemas/Receipt"}}},
    "ChatStreamErrorChunk": {
        "type": "object", "description": "The error chunk that ends a refused or failed turn's stream (JSON).",
        "required": ["error"],
        "properties": {"error": {"$ref": "#/components/schemas/ErrorObject"},
                       "ugent_segment": {"type": "string", "enum": ["error"]}}},
    "ChatStreamEvent": {"oneOf": [
        _sse({"type": "string", "enum": ["message"]}, {"type": "string"},
             "data: a ChatCompletionChunk or a ChatStreamErrorChunk as JSON, or the literal [DONE]."),
        _sse({"type": "string", "enum": CHAT_NAMED_EVENTS}, {"type": "string"},
             "A named event; data is a ChatCompletionChunk (JSON) with one empty delta and its own field: "
             "ugent.user_message → ugent_user_message (once per turn, before the answer), ugent.citations → "
             "ugent_citations (after the answer), ugent.artifacts → ugent_artifacts, ugent.artifacts_pending → "
             "ugent_artifacts_pending (read them from the receipt), ugent.receipt → ugent_receipt (ahead of a "
             "refusal: the message's receipt, naming the turn that runs)."),
    ]},
    "LogEvent": {
        "type": "object", "description": "One event of the durable log, as data: (JSON).",
        "properties": {"id": {"type": "integer"}, "type": {"type": "string"},
                       "conversation_id": {"type": "string", "nullable": True},
                       "client_id": {"type": "string", "nullable": True},
                       "channel": {"type": "string", "nullable": True},
                       "turn_id": {"type": "string", "nullable": True},
                       "ts": {"type": "string", "format": "date-time"},
                       "data": {"type": "object"},
                       "reason": {"type": "string", "enum": ["pruned", "other_store", "unknown"]},
                       "cursor": {"type": "integer"},
                       "snapshot": {"$ref": "#/components/schemas/ConversationSnapshot"}}},
    "LogStreamEvent": _sse({"type": "string", "description": "The event's type: ugent.user_message, turn.delta, "
                                                             "turn.completed, turn.failed, turn.cancelled, "
                                                             "interaction.requested, ugent.gap, …"},
                           {"type": "string", "description": "A LogEvent as JSON."},
                           "One SSE event; id is its durable cursor."),
}


def stream_components(result, generator, request, public):
    """Postprocessing hook: the SSE shapes, which no serializer describes."""
    result.setdefault("components", {}).setdefault("schemas", {}).update(STREAM_COMPONENTS)
    return result


# --- the generator that reads the async views ----------------------------------------------------

_proxies: dict[type, object] = {}


def _documented(callback):
    """A DRF view standing for an async Django view with `extend_schema` on its methods (its schema
    only: nothing calls it), else the callback itself."""
    view_class = getattr(callback, "view_class", None)
    if view_class is None or getattr(callback, "cls", None) is not None or issubclass(view_class, APIView):
        return callback
    if view_class not in _proxies:
        methods = {m: getattr(view_class, m) for m in view_class.http_method_names
                   if m != "options" and hasattr(view_class, m)}
        if not any("schema" in getattr(fn, "kwargs", {}) for fn in methods.values()):
            _proxies[view_class] = callback
        else:
            proxy = type(view_class.__name__, (APIView,),
                         {**methods, "__module__": view_class.__module__, "__doc__": view_class.__doc__})
            _proxies[view_class] = proxy.as_view()
    return _proxies[view_class]


class EndpointEnumerator(generators.EndpointEnumerator):
    """DRF's enumerator, which also takes the async views that carry extend_schema (their proxies)."""

    def _get_api_endpoints(self, patterns, prefix):
        return [(p, r, m, _documented(cb)) for p, r, m, cb in super()._get_api_endpoints(patterns, prefix)]

    def should_include_endpoint(self, path, callback):
        return super().should_include_endpoint(path, _documented(callback))

    def get_allowed_methods(self, callback):
        return super().get_allowed_methods(_documented(callback))


class SchemaGenerator(generators.SchemaGenerator):
    endpoint_inspector_cls = EndpointEnumerator



# --- examples ------------------------------------------------------------------------------------

CHAT_EXAMPLES = [
    OpenApiExample("A question", request_only=True, value={
        "model": "ugent-default", "conversation_id": "conv-1", "client_message_id": "msg-1",
        "messages": [{"role": "user", "content": "What is UGENT?"}]}),
    OpenApiExample("Streamed, with reasoning and tool events", request_only=True, value={
        "conversation_id": "conv-2", "stream": True, "include_thinking": True, "ugent_include_tool_events": True,
        "ugent_denied_tools": ["*"], "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]}),
]
