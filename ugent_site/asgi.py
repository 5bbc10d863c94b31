"""ASGI entry: /v1/ through the lean API handler, everything else (the admin) through Django's full stack;
WebSockets: /v1/ugent/live (the live call, channels_app.api_voice.LiveCallSocket), no other path.
"""
import logging as _logging
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugent_site.settings")
django_asgi_app = get_asgi_application()

from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from ugent_common import config as _config  # noqa: E402

try:  # a web process refuses to start on a [web.auth] it does not understand (the key is named)
    _config.web_auth_check()
except _config.ConfigError as _exc:
    raise ImproperlyConfigured(str(_exc)) from None

from channels.routing import ProtocolTypeRouter  # noqa: E402

from rules_app.runtime import enforce_here  # noqa: E402
from channels_app.api_voice import LiveCallSocket  # noqa: E402
from ugent_site.api_handler import ApiHandler, route, websocket_route  # noqa: E402

enforce_here()  # a web process enforces the rules on the messages it takes, and records them

application = ProtocolTypeRouter({
    "http": route(ApiHandler(), django_asgi_app),
    "websocket": websocket_route({"/v1/ugent/live": LiveCallSocket.as_asgi()}),
})

from django.conf import settings as _settings  # noqa: E402

from ugent_site.apps import operator_key_check as _operator_key_check  # noqa: E402

for _warning in _operator_key_check():  # servers mode: nothing made the operator key (createoperatorkey does)
    _logging.getLogger("ugent.web").warning("%s", _warning.msg)

from ugent_common.gcfreeze import freeze as _gc_freeze  # noqa: E402

_gc_freeze(_settings.UGENT_GC_FREEZE)  # what a started web process holds: out of the collector's walks

from ugent_common import malloctrim as _malloctrim  # noqa: E402

_malloctrim.start(_settings.UGENT_MALLOC_TRIM_SECS)  # freed C memory back to the system now and then
