"""The WeChat channel for a personal account: a OneBot 12 bridge's forward WebSocket in, its actions out.

    python -m plugins_app.channel.workers.wechat [--groups mention|all|off] [--reply-segment auto|on|off]

WeChat has no API for a personal account. A bridge logged in to the account (ComWeChatBotClient on the PC
client, or another OneBot 12 implementation with platform ``wechat``) speaks OneBot 12 (https://12.onebot.dev):
the worker connects to its forward WebSocket (``WECHAT_ONEBOT_URL``, ``Authorization: Bearer
$WECHAT_ONEBOT_ACCESS_TOKEN``), reads its events and sends actions on the same connection.

The package: ``onebot`` (the wire: the link on the SDK's ``WebSocketLink``, actions matched by ``echo``, return
codes), ``events`` (a message event as an inbound message, the group policy), ``worker`` (the ``ChannelWorker``).

* inbound: a ``private`` message is a ``user`` conversation per peer (its ``user_id``), a ``group`` message a
  ``group`` conversation (``group:<group_id>``), submitted only when it mentions the account (or quotes one of
  its messages) unless ``--groups all``; the account's own messages are not submitted; ``message_id`` is the
  idempotency key, so an event pushed twice runs one turn; a ``reply`` segment is ``reply_to``; files
  (image, voice, video, file) are fetched with ``get_file`` (base64) on the chat's lane, the bridge away or
  failing for now raising ``MediaNotReady``; each message is written in the outbox on the link's thread before
  the next frame is read (OneBot replays nothing);
* outbound: ``send_message`` per part (text split at ``--max-chars``, 2,000), files by ``upload_file`` then an
  ``image``/``file`` segment, the first part quoting the message answered (a ``reply`` segment) where the
  bridge can send one; every part the bridge took is journaled, so a retry sends only what is missing;
  ``failed`` answers: a request error (1xxxx), the platform's refusal (34xxx) or an impossible action (35xxx)
  dead-letters the delivery, anything else is retried by the hub;
* refusals the operator must fix (the handshake answered 401 or 403: the access token; 10101/10102: a bridge of
  several accounts; no URL) raise ``ChannelRefused``: the plugin is disabled with the reason. A dropped socket
  is reconnected with backoff (the SDK's link).

docs/channels/wechat.md is the operator's page.
"""
from __future__ import annotations

from .events import (CHANNEL, FILE_URL_PREFIX, GROUP_POLICIES, GROUP_PREFIX, addressed, conversation_of,
                     normalise, target_of)
from .onebot import ActionFailed, Actions, AnswerLost, BridgeAway, OneBotLink
from .worker import (DESCRIPTION, ENV_REFS, KIND, NO_REPLY_IMPLS, TEXT_LIMIT, WeChatWorker, main,
                     parse_args)

__all__ = ["ActionFailed", "Actions", "AnswerLost", "BridgeAway", "CHANNEL", "DESCRIPTION", "ENV_REFS", "FILE_URL_PREFIX",
           "GROUP_POLICIES", "GROUP_PREFIX", "KIND", "NO_REPLY_IMPLS", "OneBotLink", "TEXT_LIMIT", "WeChatWorker",
           "addressed", "conversation_of", "main", "normalise", "parse_args", "target_of"]
