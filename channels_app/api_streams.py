"""The stream endpoints: /v1/ugent/events and /activity (SSE), stop, steering, snapshots and history.

The two SSE views are async Django views, as the chat completion view is: a
stream may stay open for hours and must not hold Django's sync thread. They
authenticate and render errors exactly as the DRF views do. A stream's events come
from its process's reader of that stream (channels_app.fanout), which reads the database once per
wake-up for all its subscribers.
"""
from __future__ import annotations


from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import StreamingHttpResponse
from django.views import View
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from channels_app import api_docs as docs
from channels_app import fanout, services, streams
from channels_app.access import Viewer
from channels_app.models import Turn
from channels_app.auth import authenticate_headers
from channels_app.errors import ApplicationError, error_response, from_drf
from channels_app.api_fields import (ConversationFields, IdentityFields, channel_field, client_id_field,
                                     conversation_id_field)


def _viewer(principal, d: dict) -> Viewer:
    return services.reader_of_request(principal, d)


def _conversation(viewer, d: dict):
    return streams.conversation_for_viewer(viewer=viewer, conversation_id=d["conversation_id"],
                                           client_id=d.get("client_id", ""), channel=d.get("channel", "web"))


# --- SSE ---------------------------------------------------------------------

class EventsParams(IdentityFields):
    conversation_id = conversation_id_field(required=False)
    client_id = client_id_field()
    channel = channel_field()
    cursor = serializers.CharField(required=False, allow_blank=True, max_length=100)


class ActivityParams(EventsParams):
    conversation_id = conversation_id_field()


class _StreamView(View):
    """GET an SSE stream of the event log; Last-Event-ID (or ?cursor=) resumes strictly after it."""

    params_serializer = EventsParams
    activity = False

    async def get(self, request):
        try:
            sub = await sync_to_async(self._open, thread_sensitive=False)(request)
        except ApplicationError as exc:
            return error_response(exc)
        # one reader per conversation (or for the whole log) in this process feeds every subscriber,
        # writing to the response itself once the API handler has handed the sink its ASGI send
        sink = fanout.Sink()
        resp = StreamingHttpResponse(fanout.sse_body(sub, sink), content_type="text/event-stream; charset=utf-8")
        resp.ugent_sink = sink
        resp["Cache-Control"] = "no-cache"
        resp["X-Accel-Buffering"] = "no"
        return resp

    def _open(self, request) -> streams.Subscription:
        close_old_connections()
        principal = authenticate_headers(request.headers)
        ser = self.params_serializer(data=request.GET)
        if not ser.is_valid():
            raise from_drf(serializers.ValidationError(ser.errors))
        d = ser.validated_data
        # a refusal (a conversation not theirs) writes no actor; a subscription that opens follows its user from
        # now on, conversations they have yet to start included: the fan-out matches events to its viewer by the
        # actor's row, so the stream keeps one (reads do not)
        viewer = services.reader_of_request(principal, d)
        conversation = _conversation(viewer, d) if d.get("conversation_id") else None
        viewer = services.viewer_kept(viewer)
        # EventSource reconnects to the same URL with Last-Event-ID: the header is the newer position
        # (one that is blank, spaces included, names none, and the URL's cursor stands).
        raw = request.headers.get("Last-Event-ID")
        if raw is None or raw.strip() == "":
            raw = d.get("cursor")
        sub = streams.subscription_open(viewer=viewer, raw_cursor=raw, conversation=conversation,
                                        activity=self.activity)
        sub.auth_check = _auth_check(request.headers, d, viewer, sub)  # run once as the stream starts
        return sub


#: Why an open stream ends when the key, token or role that opened it no longer speaks for its viewer.
STREAM_AUTH_CHANGED = ("The key or identity token that opened this stream no longer speaks for its user as it did "
                       "(its caller's role or the user it names changed): open the stream again.")


def _auth_check(headers, fields: dict, viewer: Viewer, sub: streams.Subscription):
    """What an open stream asks when something may have changed (channels_app.fanout.sse_body): do the
    request's key and identity token still authenticate, as the same caller with the same role, for the
    same user? The error a new request with them would get (a revoked, rotated or deleted key: 401
    `Invalid API key.`; an expired token: its 401/403), or STREAM_AUTH_CHANGED; None while they hold
    (and the token's expiry, as read now, goes to `sub.auth_expires_at`)."""
    opened = (viewer.caller.pk, viewer.caller.role, viewer.is_operator, viewer.actor.key)

    def check() -> ApplicationError | None:
        try:
            principal = authenticate_headers(headers)
            again = services.reader_of_request(principal, fields)
        except ApplicationError as exc:
            return exc
        sub.auth_expires_at = principal.identity.expires_at if principal.identity is not None else None
        if (again.caller.pk, again.caller.role, again.is_operator, again.actor.key) != opened:
            return ApplicationError(STREAM_AUTH_CHANGED, status=403, code="stream_credentials_changed")
        return None
    return check


LAST_EVENT_ID = OpenApiParameter("Last-Event-ID", str, OpenApiParameter.HEADER, required=False,
                                 description="The last cursor read: the stream goes on strictly after it.")


class EventsStreamApi(_StreamView):
    """GET /v1/ugent/events: everything the request's user may see (optionally one conversation)."""

    @extend_schema(operation_id="events_stream", tags=["streams"], summary="SSE event stream, resumable",
                   parameters=[EventsParams, LAST_EVENT_ID],
                   responses=docs.event_stream_responses("Every event the request's user may see, or one "
                                                         "conversation's."))
    async def get(self, request):
        return await super().get(request)


class ActivityStreamApi(_StreamView):
    """GET /v1/ugent/activity?conversation_id=: one conversation's tools, questions, compaction, steering."""

    params_serializer = ActivityParams
    activity = True

    @extend_schema(operation_id="activity_stream", tags=["streams"], summary="SSE activity feed for one conversation",
                   parameters=[ActivityParams, LAST_EVENT_ID],
                   responses=docs.event_stream_responses("One conversation's tools, questions, compaction and "
                                                         "steering."))
    async def get(self, request):
        return await super().get(request)


# --- stop and steering -------------------------------------------------------

def _body_of(serializer_class, request) -> tuple[Viewer, dict]:
    """A stop/steering body, validated, and whom it acts for."""
    ser = serializer_class(data=request.data)
    ser.is_valid(raise_exception=True)
    return _viewer(request.user, ser.validated_data), ser.validated_data


def _turn_named(viewer: Viewer, d: dict, action: str) -> Turn:
    """The turn a stop/steering body names, as far as its viewer may act on it."""
    return streams.turn_for_action(viewer=viewer, conversation_id=d["conversation_id"],
                                   client_id=d.get("client_id", ""), channel=d.get("channel", "web"),
                                   turn_id=d.get("turn_id"), action=action)


class StopApi(APIView):
    """POST /v1/ugent/stop: stop a conversation's running turn (its user, the operator, or its exact turn_id)."""

    class InputSerializer(ConversationFields):
        turn_id = serializers.CharField(required=False, max_length=100)

        class Meta:
            ref_name = "StopRequest"

    @extend_schema(operation_id="stop", tags=["turns"], summary="Stop a conversation's running turn",
                   request={"application/json": InputSerializer},
                   responses={202: docs.StopSerializer, **docs.errors(400, 401, 403, 404, 409)})
    def post(self, request):
        viewer, d = _body_of(self.InputSerializer, request)
        turn = _turn_named(viewer, d, streams.STOP)
        return Response(streams.turn_stop(viewer=viewer, turn=turn), status=202)


class SteeringApi(APIView):
    """POST /v1/ugent/steering: a message for a running turn, handed to the engine before its next step.
    Only the turn's own user and the operator steer it: an exact turn_id alone lets a stranger stop a
    turn, never put words into it (channels_app.access)."""

    class InputSerializer(ConversationFields):
        turn_id = serializers.CharField(required=False, max_length=100)
        message = serializers.CharField(max_length=32000, trim_whitespace=False)
        client_message_id = serializers.CharField(required=False, max_length=255, help_text=(
            "Idempotency key: a resend (same key, same words) is answered with the first steering, "
            "duplicate: true, and steers nothing again; other words under the key are a 409."))

        class Meta:
            ref_name = "SteeringRequest"

        def validate_message(self, value):
            if not value.strip():
                raise serializers.ValidationError("message is empty: send the words that steer the turn.")
            return value

    @extend_schema(operation_id="steering", tags=["turns"], summary="Steer a running turn",
                   request={"application/json": InputSerializer},
                   responses={202: docs.SteeringSerializer, **docs.errors(400, 401, 403, 404, 409)})
    def post(self, request):
        viewer, d = _body_of(self.InputSerializer, request)
        key = d.get("client_message_id") or ""
        steering = None
        if key:  # a resend after a lost answer, found even once its turn has ended
            conv = _conversation(viewer, d)
            steering = streams.steering_repeat(conversation=conv, client_message_id=key, message=d["message"])
        duplicate = steering is not None
        if steering is None:
            turn = _turn_named(viewer, d, streams.STEER)
            steering, new = streams.turn_steer(viewer=viewer, turn=turn, message=d["message"], client_message_id=key)
            duplicate = not new
        turn = steering.turn
        body = {"object": "ugent.steering", "id": steering.id, "conversation_id": turn.conversation.external_id,
                "turn_id": turn.turn_id, "state": steering.state}
        if duplicate:
            body["duplicate"] = True
        return Response(body, status=202)


# --- snapshots and history ---------------------------------------------------

class ConversationSnapshotApi(APIView):
    """GET /v1/ugent/conversation/snapshot: where a conversation's turns stand, for a recovering client."""

    @extend_schema(operation_id="conversation_snapshot", tags=["recovery"],
                   summary="Where a conversation's turns stand", parameters=[ConversationFields],
                   responses={200: docs.ConversationSnapshotSerializer, **docs.errors(400, 401, 403, 404)})
    def get(self, request):
        ser = ConversationFields(data=request.query_params)
        ser.is_valid(raise_exception=True)
        viewer = _viewer(request.user, ser.validated_data)
        conv = _conversation(viewer, ser.validated_data)
        return Response(streams.conversation_snapshot(viewer=viewer, conversation=conv))


class SessionSnapshotApi(APIView):
    """GET /v1/ugent/snapshot: the tail of one session's messages, for its owner."""

    class InputSerializer(ConversationFields):
        limit = serializers.IntegerField(required=False, default=streams.PAGE_DEFAULT, min_value=1,
                                         max_value=streams.PAGE_MAX)

    @extend_schema(operation_id="session_snapshot", tags=["recovery"], summary="The tail of a session's messages",
                   parameters=[InputSerializer],
                   responses={200: docs.SessionSnapshotSerializer, **docs.errors(400, 401, 403, 404)})
    def get(self, request):
        ser = self.InputSerializer(data=request.query_params)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = _viewer(request.user, d)
        conv = _conversation(viewer, d)
        return Response(streams.session_tail(viewer=viewer, conversation=conv, limit=d["limit"]))


class SessionHistoryApi(APIView):
    """GET /v1/ugent/history: a session's messages that compaction hid, paged backwards with `before`."""

    class InputSerializer(ConversationFields):
        limit = serializers.IntegerField(required=False, default=streams.PAGE_DEFAULT, min_value=1,
                                         max_value=streams.PAGE_MAX)
        before = serializers.IntegerField(required=False, min_value=1)

    @extend_schema(operation_id="session_history", tags=["recovery"],
                   summary="A session's messages that compaction hid, paged", parameters=[InputSerializer],
                   responses={200: docs.SessionHistorySerializer, **docs.errors(400, 401, 403, 404)})
    def get(self, request):
        ser = self.InputSerializer(data=request.query_params)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = _viewer(request.user, d)
        conv = _conversation(viewer, d)
        return Response(streams.session_history(viewer=viewer, conversation=conv, before=d.get("before"),
                                                limit=d["limit"]))
