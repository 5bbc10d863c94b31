"""The voice endpoints of the Web Channel API: dictation, read aloud, live calls (channels_app.voice).

Thin views: the key is checked, the input read, the service answers (today: nothing installed can
transcribe or speak, so a 503 that says so, after the checks a working endpoint would make).
"""
from __future__ import annotations

from urllib.parse import parse_qs

from channels.generic.websocket import WebsocketConsumer
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.views import APIView

from channels_app import auth, services, voice
from channels_app import api_docs as docs
from channels_app.errors import ApplicationError, from_drf
from channels_app.api_fields import IdentityFields, client_id_field, conversation_id_field


class TranscribeApi(APIView):
    """POST /v1/ugent/transcribe: dictation, a recording turned into text with no turn."""

    class InputSerializer(IdentityFields):
        file = serializers.FileField(required=False, help_text="The recording (read by an engine that transcribes; "
                                                               "none ships in this build).")
        conversation_id = conversation_id_field(required=False,
                                                help_text="The conversation the words are for: someone else's is "
                                                          "a 403; one that does not exist yet is not created.")
        client_id = client_id_field()
        language = serializers.CharField(required=False, max_length=35)

        class Meta:
            ref_name = "TranscribeRequest"

    @extend_schema(operation_id="transcribe", tags=["voice"], summary="Dictation (not available in this build)",
                   description="Answers {text, language, duration_ms} where a transcription engine is installed; "
                               "none ships in this build, so it is a 503 (status.media.voice.input.dictation is "
                               "false) and nothing is kept. Someone else's conversation is a 403 first.",
                   request={"multipart/form-data": InputSerializer}, responses=docs.errors(400, 401, 403, 503))
    def post(self, request):
        ser = self.InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        if d.get("conversation_id"):  # someone else's conversation: the 403 a message into it gets
            # dictation keeps nothing, so not even the actor's row: one without a row owns no conversation
            services.conversation_writable_or_new(actor=services.actor_existing_of_request(request.user, d),
                                                  conversation_id=d["conversation_id"], client_id=d["client_id"])
        return voice.dictation()


class SpeechApi(APIView):
    """POST /v1/ugent/speech: one segment of a finished answer, spoken."""

    class SpeechInputSerializer(IdentityFields):
        conversation_id = conversation_id_field()
        turn_id = serializers.CharField(max_length=100)
        segment = serializers.IntegerField(min_value=0, required=False, default=0)

    @extend_schema(operation_id="speech", tags=["voice"], summary="Read aloud (not available in this build)",
                   description="Names a finished turn, never words. Another person's turn, an unfinished one and "
                               "an unknown one are a 404; otherwise, with no speech engine installed in this "
                               "build, a 503 (status.media.voice.output).",
                   request=SpeechInputSerializer, responses=docs.errors(400, 401, 403, 404, 503))
    def post(self, request):
        ser = self.SpeechInputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = services.reader_of_request(request.user, d)
        return voice.speech(viewer=viewer, conversation_id=d["conversation_id"], turn_id=d["turn_id"],
                            segment=d["segment"])


class LiveApi(APIView):
    """GET /v1/ugent/live: a live call (a WebSocket); none are held in this build."""

    @extend_schema(operation_id="live", tags=["voice"], summary="Live call (not available in this build)",
                   description="A WebSocket speaking protocol v1 where a voice model is installed. In this build "
                               "a WebSocket is accepted and closed at once with 4422 (4403 for another person's "
                               "conversation, 4401 for a missing or wrong key), and a plain request gets a 503 "
                               "(status.media.voice.live).",
                   responses=docs.errors(401, 403, 503))
    def get(self, request):
        return voice.live_call()


# --- the live call's WebSocket ---------------------------------------------------------------------

class LiveQuery(IdentityFields):
    """The query a live call names its conversation and user with, as an upload does."""

    conversation_id = conversation_id_field(required=False)
    client_id = client_id_field()


LIVE_QUERY_FIELDS = tuple(LiveQuery._declared_fields)


def live_socket_refusal(*, headers: dict, query: dict) -> tuple[int, str]:
    """Why a WebSocket to /v1/ugent/live closes: (close code, reason), the checks a working call would
    make first. The spec's codes: 4403 the conversation is not the caller's, 4409 a call already open,
    4422 calls unavailable here (always, in this build: nothing here holds one); a key that is missing or
    not valid closes with 4401, a user the key may not act for with 4403, user fields that do not go
    together with 4400 (4000 + the HTTP status), and so does a query field that a request's would refuse
    (too long, a control character: LiveQuery)."""
    try:
        principal = auth.authenticate_headers(headers)
        ser = LiveQuery(data=query)
        if not ser.is_valid():
            raise from_drf(serializers.ValidationError(ser.errors))
        query = ser.validated_data
        # refused in this build whatever it asks (4422), so it keeps nothing: not even its caller's Actor row
        actor = services.actor_existing_of_request(principal, query)
        if query.get("conversation_id"):
            # a call speaks into the conversation: only whoever may write into it (on the web channel, its
            # owner; not an operator acting as itself) may hold one
            services.conversation_writable_or_new(actor=actor, conversation_id=query["conversation_id"],
                                                  client_id=query.get("client_id") or "")
    except ApplicationError as exc:
        return 4000 + exc.status, exc.message
    return 4422, voice.LIVE_UNAVAILABLE


def close_reason(text: str) -> str:
    """A close frame carries at most 123 bytes of reason (RFC 6455): cut on a character boundary."""
    data = text.encode()
    return text if len(data) <= 123 else data[:120].decode(errors="ignore") + "..."


class LiveCallSocket(WebsocketConsumer):
    """GET /v1/ugent/live as a WebSocket (protocol v1). No voice model is installed in this build, so after
    the checks (key, user, conversation) every call is accepted and closed at once with the spec's code
    and why: 4401, 4403, or 4422 with voice.LIVE_UNAVAILABLE.

    A sync consumer: Channels runs its connect on asgiref's one thread-sensitive executor thread, so
    connects in a process run one at a time. Fine while every call is refused at once; a consumer that
    holds calls should be async, with its checks on the project's own threads."""

    def connect(self):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.scope.get("headers", [])}
        raw = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        query = {name: raw[name][-1] for name in LIVE_QUERY_FIELDS if raw.get(name)}
        code, reason = live_socket_refusal(headers=headers, query=query)
        self.accept()
        self.close(code=code, reason=close_reason(reason))
