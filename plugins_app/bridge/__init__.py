"""The host side of the plugin bridge (JSON-RPC 2.0 over one Unix socket per plugin); no Django.

``BridgeServer`` serves one plugin's socket and delegates to a ``Hub``;
``InMemoryHub`` is the reference hub the tests use. See docs/plugin-protocol.md.
"""
from .server import (
    AddressInUse,
    BridgeServer,
    HostUnavailable,
    Hub,
    InMemoryHub,
    JsonRpcSocketServer,
    MediaNotFound,
    MediaTooLarge,
    ServerThread,
    UnknownDelivery,
)

__all__ = [
    "AddressInUse", "BridgeServer", "HostUnavailable", "Hub", "InMemoryHub", "JsonRpcSocketServer",
    "MediaNotFound", "MediaTooLarge", "ServerThread", "UnknownDelivery",
]
