"""The voice endpoints of the Web Channel API: dictation, read aloud, live calls (channels_app.voice).

Thin views: the key is checked, the input read, the service answers (today: nothing installed can
transcribe or speak, so a 503 that says so, after the checks a working endpoint would make).
"""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.views import APIView

from channels_app import api_docs as docs
from channels_app import services, voice


class TranscribeApi(APIView):
    """POST /v1/ugent/transcribe: dictation, a recording turned into text with no turn."""

    @extend_schema(operation_id="transcribe", tags=["voice"], summary="Dictation (not available in this build)",
                   description="Answers {text, language, duration_ms} where a transcription engine is installed; "
                               "none ships in this build, so it is a 503 (status.media.voice.input.dictation is "
                               "false) and nothing is kept.",
                   request=None, responses=docs.errors(401, 403, 503))
    def post(self, request):
        return voice.dictation()


class SpeechApi(APIView):
    """POST /v1/ugent/speech: one segment of a finished answer, spoken."""

    class SpeechInputSerializer(serializers.Serializer):
        conversation_id = serializers.CharField(max_length=255)
        turn_id = serializers.CharField(max_length=100)
        segment = serializers.IntegerField(min_value=0, required=False, default=0)
        user = serializers.CharField(required=False)
        federation_issuer = serializers.CharField(required=False)
        federation_subject = serializers.CharField(required=False)

    @extend_schema(operation_id="speech", tags=["voice"], summary="Read aloud (not available in this build)",
                   description="Names a finished turn, never words. Another person's turn, an unfinished one and "
                               "an unknown one are a 404; otherwise, with no speech engine installed in this "
                               "build, a 503 (status.media.voice.output).",
                   request=SpeechInputSerializer, responses=docs.errors(400, 401, 403, 404, 503))
    def post(self, request):
        ser = self.SpeechInputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = services.viewer_of_request(request.user, d)
        return voice.speech(viewer=viewer, conversation_id=d["conversation_id"], turn_id=d["turn_id"],
                            segment=d["segment"])


class LiveApi(APIView):
    """GET /v1/ugent/live: a live call (a WebSocket); none are held in this build."""

    @extend_schema(operation_id="live", tags=["voice"], summary="Live call (not available in this build)",
                   description="A WebSocket speaking protocol v1 where a voice model is installed; in this build "
                               "a 503 (status.media.voice.live).",
                   responses=docs.errors(401, 403, 503))
    def get(self, request):
        return voice.live_call()
