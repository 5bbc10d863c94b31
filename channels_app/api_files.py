"""The file endpoints of the Web Channel API: POST /v1/files and GET /v1/files/{id} (docs/files.md).

Thin views over channels_app/files.py: the upload names its conversation and user as a chat request
does (form fields), the download as the receipt does (query parameters).
"""
from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.utils.http import content_disposition_header
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from channels_app import api_docs as docs
from channels_app import files, services
from channels_app.errors import ApplicationError
from channels_app.api_fields import IdentityFields, client_id_field, conversation_id_field

#: What a multipart body may carry beside the file itself before its Content-Length alone is a 413.
FORM_OVERHEAD = 64 * 1024


class FileObjectSerializer(serializers.Serializer):
    """OpenAI's file object, with the sniffed mime, the link to download it and when it expires."""

    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["file"])
    bytes = serializers.IntegerField()
    created_at = serializers.IntegerField()
    filename = serializers.CharField()
    purpose = serializers.CharField()
    mime = serializers.CharField(help_text="Sniffed from the bytes; the download's Content-Type.")
    url = serializers.CharField(help_text="The link: /v1/files/<id>, for its conversation's owner.")
    expires_at = serializers.IntegerField(help_text="When retention deletes it (UGENT_PLUGIN_MEDIA_TTL_SECS).")
    conversation_id = serializers.CharField()


class FileUploadApi(APIView):
    """POST /v1/files: upload one file into a conversation (multipart)."""

    parser_classes = [MultiPartParser]

    class InputSerializer(IdentityFields):
        file = serializers.FileField(help_text="The file; its type is sniffed from the bytes, its name kept.")
        conversation_id = conversation_id_field(help_text=(
            "The conversation; a first upload creates it and makes the uploader its owner."))
        purpose = serializers.ChoiceField(choices=files.PURPOSES, required=False, default="user_data")
        client_id = client_id_field()

    @extend_schema(operation_id="files_create", tags=["files"], summary="Upload a file into a conversation",
                   description=("A conversation belongs to whoever first sends a message in it or uploads a "
                                "file to it; a file on someone else's conversation is refused with a 403 and "
                                "stores nothing. Larger than UGENT_FILES_MAX_BYTES: 413."),
                   request={"multipart/form-data": InputSerializer},
                   responses={200: FileObjectSerializer, **docs.errors(400, 401, 403),
                              413: OpenApiResponse(docs.ErrorSerializer, description="The file is too large."),
                              415: OpenApiResponse(docs.ErrorSerializer, description="Not a multipart body.")})
    def post(self, request):
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > settings.UGENT_FILES_MAX_BYTES + FORM_OVERHEAD:  # refused before the body is parsed
            raise files.upload_too_large(length)
        ser = self.InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        actor = services.actor_named_of_request(request.user, d)
        f = files.file_upload(actor=actor, caller=request.user.caller, upload=d["file"],
                              conversation_id=d["conversation_id"], client_id=d.get("client_id") or "",
                              purpose=d["purpose"])
        return Response(files.file_object(f))


BINARY = {"type": "string", "format": "binary"}


class FileGetApi(APIView):
    """GET /v1/files/{id}: the file's bytes, with byte ranges, for its conversation's owner and the operator."""

    class InputSerializer(IdentityFields):
        """Whom the download is for (query parameters)."""

    @extend_schema(
        operation_id="files_get", tags=["files"], summary="Download a file, with byte ranges",
        description=("Only its conversation's owner and the operator; to anyone else, and once retention has "
                     "deleted it, a 404 as for a missing file. Range answers 206 (one range; several, or one "
                     "this server cannot read, get the whole file), a range that starts past the end 416; "
                     "If-None-Match with the ETag 304."),
        parameters=[InputSerializer,
                    OpenApiParameter("Range", str, OpenApiParameter.HEADER, required=False),
                    OpenApiParameter("If-None-Match", str, OpenApiParameter.HEADER, required=False),
                    OpenApiParameter("If-Range", str, OpenApiParameter.HEADER, required=False)],
        responses={(200, "*/*"): OpenApiResponse(BINARY, description="The whole file."),
                   (206, "*/*"): OpenApiResponse(BINARY, description="One range (Content-Range)."),
                   304: OpenApiResponse(description="Not modified (If-None-Match)."),
                   (400, "application/json"): docs.errors(400)[400],
                   (401, "application/json"): docs.errors(401)[401],
                   (403, "application/json"): docs.errors(403)[403],
                   (404, "application/json"): docs.errors(404)[404],
                   (416, "application/json"): OpenApiResponse(docs.ErrorSerializer, description=(
                       "The range starts past the end (Content-Range: bytes */<size>)."))})
    def get(self, request, file_id: str):
        ser = self.InputSerializer(data=request.query_params)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        viewer = services.reader_of_request(request.user, d)
        f = files.file_for_download(viewer=viewer, file_id=file_id)
        validators = {"ETag": files.etag(f), "Accept-Ranges": "bytes", "Cache-Control": "private, no-cache"}
        if files.not_modified(f, request.headers.get("If-None-Match")):
            return _with(HttpResponse(status=304), validators)
        wanted = files.WHOLE
        if files.range_applies(f, request.headers.get("If-Range")):
            wanted = files.range_parse(request.headers.get("Range"), f.size)
        if wanted.unsatisfiable:
            raise ApplicationError(files.RANGE_PAST_END.format(size=f.size), status=416,
                                   code="range_not_satisfiable", param="Range",
                                   headers={"Content-Range": f"bytes */{f.size}", **validators})
        if wanted.whole:
            resp = HttpResponse(files.file_read(f, 0, f.size), content_type=f.mime)
        else:
            resp = HttpResponse(files.file_read(f, wanted.start, wanted.end - wanted.start + 1), status=206,
                                content_type=f.mime)
            resp["Content-Range"] = f"bytes {wanted.start}-{wanted.end}/{f.size}"
        resp["Content-Disposition"] = content_disposition_header(False, f.filename)
        return _with(resp, validators)


def _with(resp: HttpResponse, headers: dict) -> HttpResponse:
    for k, v in headers.items():
        resp[k] = v
    return resp
