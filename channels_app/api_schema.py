"""The schema's own endpoints: GET /v1/openapi.json and the Swagger UI page at /v1/docs.

Apart from channels_app.api_docs because drf-spectacular's views import the settings' generator
(api_docs.SchemaGenerator), which would import them back.
"""
from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularSwaggerView


SCHEMA_MEDIA_TYPES = ("application/vnd.oai.openapi+json", "application/json")
SCHEMA_RESPONSE = OpenApiResponse({"type": "object", "required": ["openapi", "info", "paths"]},
                                  description="OpenAPI 3.0, as JSON (by content negotiation on Accept).")


class OpenApiSchemaApi(SpectacularJSONAPIView):
    """GET /v1/openapi.json: this schema, as JSON. No key: it describes the API, never anyone's data."""

    @extend_schema(operation_id="openapi_schema", tags=["host"], summary="This OpenAPI schema (no key)",
                   parameters=[], responses={(200, media): SCHEMA_RESPONSE for media in SCHEMA_MEDIA_TYPES})
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)


class OpenApiDocsPage(SpectacularSwaggerView):
    """GET /v1/docs: Swagger UI over /v1/openapi.json, its assets from our static files (the sidecar)."""

    url_name = "openapi-schema"
