"""POST /v1/ugent/commands, and the operator's sandbox, directory and repair endpoints.

Thin views: each validates its body, calls one service (channels_app.commands, channels_app.sandbox,
channels_app.repair) and renders its answer. The three operator endpoints answer operator keys only,
as GET /v1/ugent/status does (403 to any other key).
"""
from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from channels_app import api_docs as docs
from channels_app import commands, repair, sandbox, services, streams
from channels_app.auth import IsOperator
from channels_app.errors import ApplicationError
from channels_app.api_fields import IdentityFields, channel_field, client_id_field, conversation_id_field
from channels_app.json_input import JsonInput


class CommandsApi(APIView):
    """POST /v1/ugent/commands: one slash command for the request's user (docs/commands.md)."""

    class InputSerializer(IdentityFields):
        command = serializers.CharField(max_length=32000, trim_whitespace=False,
                                        help_text='The command as typed, e.g. "/model gpt-x" or "/btw what is X?".')
        conversation_id = conversation_id_field(required=False,
                                                help_text="The conversation it acts on (needed by /steering, "
                                                          "/harness, /refine, /compress); never created by a "
                                                          "command.")
        client_id = client_id_field()
        turn_id = serializers.CharField(required=False, max_length=100,
                                        help_text="/steering: the exact turn to steer (else the running one).")

        class Meta:
            ref_name = "CommandRequest"

    @extend_schema(operation_id="commands", tags=["commands"], summary="Run a slash command",
                   description=("/model, /models, /recall, /steering, /btw, /harness, /refine, /sandbox and "
                                "/compress. Changes (storing /model, /harness edits, /steering, /compress) need "
                                "the caller's "
                                "allow_remote_control (403 otherwise); anything else is answered 200 with "
                                "unsupported: true and the list of supported commands."),
                   request={"application/json": InputSerializer},
                   examples=[OpenApiExample("show the model", value={"command": "/model"}, request_only=True),
                             OpenApiExample("list the models", value={"command": "/models"}, request_only=True),
                             OpenApiExample("the sandbox", value={"command": "/sandbox"}, request_only=True)],
                   responses={200: docs.CommandResultSerializer, **docs.errors(400, 401, 403, 404, 409)})
    def post(self, request):
        ser = self.InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        # no Actor row until a command stores something for its user (/model NAME): a refusal, a read and an
        # unknown command write none
        viewer = services.reader_of_request(request.user, d)
        return Response(commands.command_run(viewer=viewer, command=d["command"],
                                             conversation_id=d.get("conversation_id"),
                                             client_id=d.get("client_id", ""), turn_id=d.get("turn_id")))


class OperatorConversationFields(JsonInput):
    conversation_id = conversation_id_field()
    client_id = client_id_field()
    channel = channel_field()


def _conversation(d: dict):
    conv = streams.conversation_lookup(conversation_id=d["conversation_id"], client_id=d.get("client_id", ""),
                                       channel=d.get("channel", "web"))
    if conv is None:
        raise ApplicationError(streams.NO_CONVERSATION, status=404, code="conversation_not_found",
                               param="conversation_id")
    return conv


class SandboxApi(APIView):
    """GET /v1/ugent/sandbox: what the sandbox allows and where it is (operator keys only)."""

    permission_classes = [IsOperator]

    class InputSerializer(JsonInput):
        conversation_id = conversation_id_field(required=False)
        client_id = client_id_field()
        channel = channel_field()

        class Meta:
            ref_name = "SandboxQuery"

    @extend_schema(operation_id="sandbox", tags=["host"], summary="What the sandbox allows (operator keys only)",
                   parameters=[InputSerializer],
                   responses={200: docs.SandboxSerializer, **docs.errors(400, 401, 403, 404)})
    def get(self, request):
        ser = self.InputSerializer(data=request.query_params)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        conv = _conversation(d) if d.get("conversation_id") else None
        return Response(sandbox.sandbox_describe(conversation=conv, every_conversation=True))


class DirectoryApi(APIView):
    """PUT /v1/ugent/directory: a conversation's working directory inside the workspace (operator keys only)."""

    permission_classes = [IsOperator]

    class InputSerializer(OperatorConversationFields):
        directory = serializers.CharField(max_length=1000, allow_blank=True, trim_whitespace=False,
                                          help_text='Relative to the workspace root ("" or "." for the root), '
                                                    "or an absolute path inside it.")

        class Meta:
            ref_name = "DirectoryRequest"

    @extend_schema(operation_id="directory_set", tags=["host"],
                   summary="Set a conversation's working directory (operator keys only)",
                   request={"application/json": InputSerializer},
                   responses={200: docs.DirectorySerializer, **docs.errors(400, 401, 403, 404)})
    def put(self, request):
        ser = self.InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        return Response(sandbox.conversation_directory_set(conversation=_conversation(d), directory=d["directory"]))


class ConversationRepairApi(APIView):
    """POST /v1/ugent/conversations/repair: re-derive a conversation's receipts and turn states (operator keys only)."""

    permission_classes = [IsOperator]

    class InputSerializer(OperatorConversationFields):
        class Meta:
            ref_name = "RepairRequest"

    @extend_schema(operation_id="conversation_repair", tags=["recovery"],
                   summary="Re-derive a conversation's receipts and turn states (operator keys only)",
                   description="Idempotent: a second run fixes nothing. Never answers a message twice.",
                   request={"application/json": InputSerializer},
                   responses={200: docs.RepairSerializer, **docs.errors(400, 401, 403, 404)})
    def post(self, request):
        ser = self.InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        return Response(repair.conversation_repair(conversation=_conversation(ser.validated_data)))
