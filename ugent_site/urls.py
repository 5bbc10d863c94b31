from django.contrib import admin
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt

from channels_app import api, api_commands, api_schema
from ugent_site import views
from ugent_site.metrics import metrics_view

urlpatterns = [
    path("", views.home, name="home"),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("v1/chat/completions", csrf_exempt(api.ChatCompletionApi.as_view()), name="chat-completions"),
    path("v1/models", api.ModelsListApi.as_view(), name="models"),
    # a path: a model id may hold a "/" (an OpenAI-style id); ids are never an endpoint's name
    path("v1/models/<path:model>", api.ModelGetApi.as_view(), name="model"),
    path("v1/health", api.HealthApi.as_view(), name="health"),
    path("v1/ugent/receipt", api.ReceiptGetApi.as_view(), name="receipt"),
    path("v1/ugent/status", api.StatusApi.as_view(), name="status"),
    path("v1/ugent/commands", api_commands.CommandsApi.as_view(), name="commands"),
    path("v1/ugent/sandbox", api_commands.SandboxApi.as_view(), name="sandbox"),
    path("v1/ugent/directory", api_commands.DirectoryApi.as_view(), name="directory"),
    path("v1/ugent/conversations/repair", api_commands.ConversationRepairApi.as_view(), name="conversation-repair"),
    path("", include("channels_app.urls_streams")),
    # The API schema (no key: it describes the API, never anyone's data) and its Swagger UI page.
    path("v1/openapi.json", api_schema.OpenApiSchemaApi.as_view(), name="openapi-schema"),
    path("v1/docs", api_schema.OpenApiDocsPage.as_view(), name="openapi-docs"),
]
