"""The site's front page, where the admin's "View site" leads: what is running here and where to go."""
from django.conf import settings
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse


def _url(name: str) -> str | None:
    try:
        return reverse(name)
    except NoReverseMatch:
        return None


def home(request):
    base = request.build_absolute_uri("/v1")
    links = [(label, url) for label, url in (
        ("The admin (the control room)", reverse("admin:index")),
        ("Health (no key needed)", _url("health")),
        ("API schema (Swagger UI)", _url("openapi-docs")),
        ("OpenAPI document", _url("openapi-schema")),
    ) if url]
    # the page answers anyone: a host path is shown to the admin's staff only, as the API shows host paths to
    # operator keys only (channels_app.access.host_paths_readable)
    staff = bool(getattr(request, "user", None) and request.user.is_active and request.user.is_staff)
    return render(request, "ugent_site/home.html", {
        "api_base": base, "mode": settings.UGENT_MODE, "links": links,
        "key_file": settings.UGENT_WEB_API_KEY_FILE if staff else None})
