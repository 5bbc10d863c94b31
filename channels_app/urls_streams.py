"""The stream and file endpoints of the Web Channel API (included by ugent_site/urls.py)."""
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from channels_app import api_files, api_voice
from channels_app import api_streams as api

urlpatterns = [
    path("v1/ugent/events", csrf_exempt(api.EventsStreamApi.as_view()), name="events"),
    path("v1/ugent/activity", csrf_exempt(api.ActivityStreamApi.as_view()), name="activity"),
    path("v1/ugent/stop", api.StopApi.as_view(), name="stop"),
    path("v1/ugent/steering", api.SteeringApi.as_view(), name="steering"),
    path("v1/ugent/conversation/snapshot", api.ConversationSnapshotApi.as_view(), name="conversation-snapshot"),
    path("v1/ugent/snapshot", api.SessionSnapshotApi.as_view(), name="session-snapshot"),
    path("v1/ugent/history", api.SessionHistoryApi.as_view(), name="session-history"),
    path("v1/ugent/transcribe", api_voice.TranscribeApi.as_view(), name="transcribe"),
    path("v1/ugent/speech", api_voice.SpeechApi.as_view(), name="speech"),
    path("v1/ugent/live", api_voice.LiveApi.as_view(), name="live"),
    path("v1/files", api_files.FileUploadApi.as_view(), name="files"),
    path("v1/files/<str:file_id>", api_files.FileGetApi.as_view(), name="file"),
]
