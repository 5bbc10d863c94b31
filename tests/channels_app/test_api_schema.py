"""The API schema (issue #12, item 9): served, valid with zero warnings, and complete.

`manage.py spectacular --validate --fail-on-warn` runs here, so it runs in `make test`. The schemathesis
run over the served schema is tests/e2e/test_schemathesis.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.contrib.staticfiles import finders
from django.test import Client

from channels_app.api import ChatInputSerializer
from channels_app.api_docs import CHAT_NAMED_EVENTS, SEGMENTS
from tests.channels_app.test_permissions import v1_routes
from tests.conftest import APP_KEY, OPERATOR_KEY, OUTSIDER_KEY

ROOT = Path(__file__).resolve().parents[2]
#: /v1 routes that are pages, not API operations.
PAGES = {"v1/docs"}
#: Every field the seed's "Chat request extensions" table names, beside OpenAI's model/messages/stream.
SEED_EXTENSIONS = {"conversation_id", "client_message_id", "client_id", "turn_id", "user", "federation_issuer",
                   "federation_subject", "include_thinking", "echo_user_message", "ugent_allowed_tools",
                   "ugent_denied_tools", "ugent_include_tool_events", "ugent_citation_ids",
                   "ugent_disable_memory_recall", "ugent_disable_code_context", "ugent_disable_memory_write",
                   "ugent_input_mode", "ugent_interaction_reply"}


@pytest.fixture(scope="module")
def schema(django_db_blocker):
    with django_db_blocker.unblock():
        resp = Client().get("/v1/openapi.json")
    assert resp.status_code == 200, resp.content[:500]
    return resp.json()


def _route_as_path(route: str) -> str:
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def test_manage_spectacular_validates_the_schema_with_no_warning(tmp_path):
    out = tmp_path / "schema.json"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "ugent_site.settings"}
    proc = subprocess.run([sys.executable, "manage.py", "spectacular", "--validate", "--fail-on-warn",
                           "--format", "openapi-json", "--file", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]
    assert "/v1/chat/completions" in out.read_text()


def test_every_v1_endpoint_is_described_and_nothing_else(schema):
    routes = {_route_as_path(r) for r in v1_routes() if r not in PAGES}
    assert "/v1/chat/completions" in routes and "/v1/ugent/events" in routes
    assert set(schema["paths"]) == routes


def test_chat_completions_describes_every_ugent_extension_and_each_field_says_what_it_is(schema):
    op = schema["paths"]["/v1/chat/completions"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    props = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    assert SEED_EXTENSIONS <= set(props)
    assert set(props) == set(ChatInputSerializer().fields)  # a field added to the view is described too
    undescribed = [name for name, p in props.items() if not p.get("description")]
    assert undescribed == []
    assert props["ugent_input_mode"]["nullable"] is True
    mode = schema["components"]["schemas"][props["ugent_input_mode"]["allOf"][0]["$ref"].rsplit("/", 1)[1]]
    assert mode["enum"] == ["voice", "live"]
    assert set(op["responses"]) >= {"200", "202", "400", "401", "403", "409"}


def test_the_chat_stream_describes_its_segments_and_named_events(schema):
    op = schema["paths"]["/v1/chat/completions"]["post"]
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    comps = schema["components"]["schemas"]
    events = comps["ChatStreamEvent"]["oneOf"]
    names = [n for e in events for n in e["properties"]["event"]["enum"]]
    assert names == ["message", *CHAT_NAMED_EVENTS]
    assert CHAT_NAMED_EVENTS == ["ugent.user_message", "ugent.citations", "ugent.artifacts",
                                 "ugent.artifacts_pending", "ugent.receipt"]  # the seed's table
    delta = comps["ChatCompletionChunk"]["properties"]["choices"]["items"]["properties"]["delta"]
    assert delta["properties"]["ugent_segment"]["enum"] == SEGMENTS == ["answer", "thinking", "tool", "error",
                                                                         "answer_reset"]
    for stream in ("/v1/ugent/events", "/v1/ugent/activity"):
        content = schema["paths"][stream]["get"]["responses"]["200"]["content"]
        assert list(content) == ["text/event-stream"]
        params = {p["name"] for p in schema["paths"][stream]["get"]["parameters"]}
        assert {"cursor", "Last-Event-ID", "conversation_id"} <= params


def test_usage_is_described_as_openai_does(schema):
    comps = schema["components"]["schemas"]
    usage = comps["ChatCompletion"]["properties"]["usage"]
    assert usage == {"$ref": "#/components/schemas/Usage"}
    assert "usage" not in comps["ChatCompletion"]["required"]
    assert set(comps["Usage"]["required"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert comps["ChatCompletionChunk"]["properties"]["usage"] == usage


def test_keys_are_described_as_x_api_key_or_bearer_and_health_needs_none(schema):
    schemes = schema["components"]["securitySchemes"]
    assert schemes["ApiKeyHeader"] == {**schemes["ApiKeyHeader"], "type": "apiKey", "in": "header",
                                       "name": "x-api-key"}
    assert schemes["BearerKey"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/ugent/receipt"]["get"]["security"] == [{"ApiKeyHeader": []}, {"BearerKey": []}]
    assert "security" not in schema["paths"]["/v1/health"]["get"]
    assert "ApiKeyHeader" not in str(schema["paths"]["/v1/openapi.json"]["get"].get("security"))


@pytest.mark.django_db
@pytest.mark.parametrize("key", [None, OPERATOR_KEY, APP_KEY, OUTSIDER_KEY, "ugk_wrong"])
def test_the_schema_and_its_page_answer_every_caller_alike(cast, key):
    headers = {"HTTP_X_API_KEY": key} if key else {}
    schema = Client().get("/v1/openapi.json", **headers)
    page = Client().get("/v1/docs", **headers)
    assert schema.status_code == 200 and page.status_code == 200
    assert schema.json()["openapi"].startswith("3.")
    assert Client().get("/v1/openapi.json").content == schema.content


class _Assets(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name):
                self.urls.append(attrs[name])
        self._in_script = tag == "script"

    def handle_data(self, data):
        if self._in_script:
            self.inline.append(data)

    def handle_endtag(self, tag):
        self._in_script = False


@pytest.mark.django_db
def test_the_swagger_page_loads_its_assets_from_our_static_files_not_a_cdn(settings):
    page = Client().get("/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    parser = _Assets()
    parser.feed(html)
    assert parser.urls, "the page references no asset"
    static = "/" + settings.STATIC_URL.strip("/") + "/"
    for url in parser.urls:
        assert not re.match(r"^(https?:)?//", url), f"an asset from elsewhere: {url}"
        assert url.startswith(static), url
        assert finders.find(url[len(static):].split("?")[0]), f"{url} is not among the static files"
    assert any("swagger-ui" in u for u in parser.urls)
    assert "/v1/openapi.json" in html  # the page reads the served schema
    assert not re.search(r"https?://(?!127\.0\.0\.1|localhost)", "".join(parser.inline))


def test_dictation_describes_its_multipart_request(schema):
    body = schema["paths"]["/v1/ugent/transcribe"]["post"]["requestBody"]["content"]
    assert list(body) == ["multipart/form-data"]
    fields = schema["components"]["schemas"][body["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]]
    assert {"file", "conversation_id", "client_id", "language", "user", "federation_issuer",
            "federation_subject"} <= set(fields["properties"])


def test_the_sandbox_report_says_a_non_operator_sees_no_host_path(schema):
    """/sandbox through POST /v1/ugent/commands shows anyone but an operator key the report with
    workspace_root null and the paths relative to the workspace root (docs/commands.md)."""
    report = schema["components"]["schemas"]["Sandbox"]["properties"]
    assert report["workspace_root"]["nullable"] is True and "null" in report["workspace_root"]["description"]
    assert "relative" in report["writable_paths"]["description"]
    directory = schema["components"]["schemas"]["WorkingDirectory"]["properties"]
    assert "relative" in directory["path"]["description"]
