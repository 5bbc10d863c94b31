"""The host side of the plugin bridge (JSON-RPC 2.0 over one Unix socket per plugin); no Django.

The parts, one module each:

* ``errors``: the RPC errors a hub raises (unknown delivery, media, host unavailable).
* ``hub``: the ``Hub`` interface the bridge calls (the Django hub is ``plugins_app.channel.hub``).
* ``policy``: the delivery policy both hubs keep (in-flight limit, retries, backoff, dead letters, claims).
* ``transport``: the private Unix socket, framing, per-connection tasks and the ``HelloGate``.
* ``ratelimit``: ``TokenBucket``, the plugin's ``inbound.submit`` rate.
* ``server``: ``BridgeServer``, the protocol's methods for one plugin.
* ``memory``: ``InMemoryHub``, the reference hub the SDK's ``MockBridge`` and the tests use.
* ``thread``: ``ServerThread``, a server on its own event loop for synchronous callers.

See docs/plugin-protocol.md.
"""
from .errors import HostUnavailable, MediaNotFound, MediaTooLarge, RateLimited, UnknownDelivery
from .hub import Hub
from .memory import InMemoryHub
from .server import BridgeServer
from .thread import ServerThread
from .ratelimit import TokenBucket
from .transport import AddressInUse, HelloGate, JsonRpcSocketServer

__all__ = [
    "AddressInUse", "BridgeServer", "HelloGate", "HostUnavailable", "Hub", "InMemoryHub", "JsonRpcSocketServer",
    "MediaNotFound", "MediaTooLarge", "RateLimited", "ServerThread", "TokenBucket", "UnknownDelivery",
]
