"""ugent_site/api_handler.ApiHandler.handle is a copy of Django's ASGIHandler.handle (without the
request signals and the thread hop to close). When the installed Django's version of that method
changes, the copy must be read against it again: this test says so instead of letting them drift."""
import hashlib
import inspect

import django
from django.core.handlers.asgi import ASGIHandler

#: sha256 of inspect.getsource(ASGIHandler.handle) in the Django the copy was last read against.
REVIEWED = {"5.2.19": "98faeb5bef800331e6a8002fbc96b30e4122a23438ae45a047190a531ea11323"}


def test_djangos_asgi_handle_is_the_one_the_copy_was_made_from():
    source = inspect.getsource(ASGIHandler.handle)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest in REVIEWED.values(), (
        f"Django {django.get_version()} changed ASGIHandler.handle: compare it with "
        "ugent_site/api_handler.ApiHandler.handle, carry the change over, then add "
        f"{{{django.get_version()!r}: {digest!r}}} to REVIEWED")


def test_the_copy_still_overrides_handle():
    from ugent_site.api_handler import ApiHandler
    assert ApiHandler.handle is not ASGIHandler.handle
    assert "body_file = await self.read_body(receive)" in inspect.getsource(ApiHandler.handle)
