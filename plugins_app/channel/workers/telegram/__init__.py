"""The Telegram channel: a Bot API worker on python-telegram-bot, in polling or webhook mode.

    python -m plugins_app.channel.workers.telegram --mode polling|webhook [options]

The package: ``updates`` (Bot API updates → inbound messages), ``markup`` (Markdown → MarkdownV2,
keyboards), ``worker`` (the ``ChannelWorker``, limits, the sent-parts journal, the webhook listener).

Environment: ``TELEGRAM_BOT_TOKEN`` (from @BotFather) and ``TELEGRAM_API_BASE_URL`` (default
``https://api.telegram.org/bot``; the token is appended as the Bot API does, so a local Bot API
server or a test fake is one variable away). Files download from the same host's ``/file/bot``; one
Telegram cannot give now (a 5xx, a 429, a timeout) raises ``MediaNotReady``: the message waits, its
chat only, and the SDK fetches again. A 400 (``file is too big``) or a 413 is final (a note); a 401
confirmed by ``getMe`` stops the worker with the message owed.

* inbound: ``getUpdates`` long polls in a thread of their own (the offset moves past an update only
  once its message is in the outbox) or a webhook listener (``X-Telegram-Bot-Api-Secret-Token``
  checked; answered 200 once the message is in the outbox, a 5xx if it could not be written, so
  Telegram sends it again); either way each chat's messages then go to the hub on a lane of that
  chat's, so one chat's file download holds back no other and nothing Telegram waits on waits for a
  file or the hub; ``update_id`` is the idempotency key;
  ``chat.type`` gives the source type (private → user, group/supergroup → group, channel → room);
* outbound: Markdown converted to MarkdownV2 (plain text again if Telegram cannot parse it), split
  at 4096 UTF-16 units, attachments as ``sendPhoto``/``sendDocument``, a delivery's
  ``metadata["options"]`` as an inline keyboard whose presses come back as messages; every part
  sent is journaled, so a restart after a crash sends only the parts still missing;
* limits: ``retry_after`` of a 429 waited out and the same send retried; at most one message a
  second per private chat, one every three seconds per group, thirty a second in all;
* refusals the operator must fix (401 bad or revoked token, 409 a second poller or a webhook still
  set, the webhook replaced) raise ``ChannelRefused``: the plugin is disabled with the reason.

docs/channels/telegram.md is the operator's page.
"""
from __future__ import annotations

KIND = "channel-telegram"
DESCRIPTION = "Telegram: a Bot API bot, by getUpdates polling or a webhook (python-telegram-bot)."
ENV_REFS = ("TELEGRAM_BOT_TOKEN",)

from .markup import escape_v2, keyboard_of, markdown_to_v2  # noqa: E402
from .updates import FILE_URL_PREFIX, SOURCE_TYPES, conversation_of, normalise, parse_conversation, reply_message_id  # noqa: E402
from .worker import (DEFAULT_BASE_URL, RateLimiter, SentJournal, TelegramWorker, file_base_url, main,  # noqa: E402
                     parse_args, webhook_secret)

__all__ = ["DEFAULT_BASE_URL", "DESCRIPTION", "ENV_REFS", "FILE_URL_PREFIX", "KIND", "RateLimiter", "SOURCE_TYPES",
           "SentJournal", "TelegramWorker", "conversation_of", "escape_v2", "file_base_url", "keyboard_of", "main",
           "markdown_to_v2", "normalise", "parse_args", "parse_conversation", "reply_message_id", "webhook_secret"]
