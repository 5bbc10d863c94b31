"""The channel worker SDK: everything a plugin worker needs to speak the bridge protocol.

Imports nothing from Django, so a worker starts fast and stands alone:

* ``ChannelWorker`` (worker.py): the lifecycle; a channel implements connect,
  listen, deliver and optionally media;
* ``InboundMessage``/``Delivery``/``Attachment`` (messages.py): the shapes;
* ``Outbox`` (outbox.py): the crash-recovery record of unsettled messages;
* ``RpcClient`` (client.py) and ``jsonrpc`` (framing, codes, dispatcher);
* ``download`` (``plugins_app.channel.sdk.download``): GET a platform's file for ``fetch_media``,
  ``MediaNotReady`` when the platform cannot give it now (imports httpx when called);
* ``MockBridge`` (``plugins_app.channel.sdk.mock``, imported on its own): a fake host for tests.

docs/plugin-protocol.md is the wire protocol, for workers in other languages.
"""
from .client import CallTimeout, ConnectionLost, RpcClient, connect_with_retry
from .jsonrpc import Dispatcher, InvalidParams, RPCError
from .messages import (
    Attachment,
    InboundMessage,
    Media,
    MessageValidationError,
    Delivery,
    ReplyContext,
)
from .outbox import Outbox
from .worker import ChannelRefused, ChannelWorker, DeliveryFailed, MediaNotReady, SubmitResult

__all__ = [
    "Attachment", "CallTimeout", "ChannelRefused", "ChannelWorker", "ConnectionLost", "DeliveryFailed", "Dispatcher",
    "InboundMessage", "InvalidParams", "Media", "MediaNotReady", "MessageValidationError", "Delivery", "Outbox",
    "RPCError", "ReplyContext", "RpcClient", "SubmitResult", "connect_with_retry",
]
