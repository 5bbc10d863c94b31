"""The email channel: IMAP IDLE in, SMTP out, built on the worker SDK.

    python -m plugins_app.channel.workers.email [--imap-security ssl|none] [--smtp-security starttls|ssl|none] ...

* **Inbound.** One IMAP connection SELECTs the mailbox and waits in IDLE, re-issued
  every ``--idle-secs`` (25 minutes by default, under the 29 minutes RFC 2177 allows).
  Every message with a UID past the worker's cursor is fetched (``BODY.PEEK[]``),
  normalised and submitted; the cursor ``(UIDVALIDITY, UID)`` is committed only once
  the SDK's outbox holds the message, so a crash or a dropped connection loses nothing
  and a reconnect reads on from where it stopped. The message's ``Message-ID`` is the
  inbound idempotency key (the same mail delivered twice, or renumbered by a new
  UIDVALIDITY, runs one turn); without one, ``uid:<UIDVALIDITY>:<UID>``. Attachments
  travel inside the mail; only when their bytes are no longer in memory (a restart, or the
  host away when the mail came) are they read again from the server, and a server that
  cannot answer then (unreachable, timing out, hanging up, a ``NO [UNAVAILABLE]``; for Gmail
  push a 429/5xx) raises ``MediaNotReady``: the message waits, its chat only, and is tried
  again. A mail no longer there is final (a note, never the IMAP URL); a refused login stops
  the worker with the message owed.
* **Threads.** ``In-Reply-To``/``References`` pick the conversation: the conversation
  id is the thread's root Message-ID, and every id seen in a thread (ours included)
  maps back to it, so a reply that carries only ``In-Reply-To`` lands in its thread.
* **Never answered**: auto-replies and bounces (``Auto-Submitted`` other than ``no``,
  ``Precedence: bulk|junk|list``, ``X-Autoreply``, ``X-Autorespond``, a null
  ``Return-Path``, MAILER-DAEMON/postmaster senders, ``multipart/report``) and the
  worker's own mail.
* **Outbound.** A reply over SMTP (aiosmtplib) with ``In-Reply-To``, ``References``,
  ``Re:`` subject, a deterministic ``Message-ID`` from the delivery id, ``Auto-Submitted:
  auto-replied`` (RFC 3834, so other robots do not answer it), and both a text/plain part
  (the Markdown as written) and a text/html part (rendered by markdown-it, raw HTML off);
  attachments from the host's media. A transient SMTP reply (421/45x: greylisting, rate
  limits) waits and retries the same send; a refused login (535) stops the worker with
  a clear state; a refused recipient is a permanent failure.

Variables: EMAIL_IMAP_HOST, EMAIL_IMAP_PORT, EMAIL_IMAP_USER, EMAIL_IMAP_PASSWORD,
EMAIL_SMTP_HOST, EMAIL_SMTP_PORT (SMTP logs in with the IMAP user and password when the
server offers AUTH), and optionally EMAIL_ADDRESS (the From address; the IMAP user by default).

Modules: ``parse`` (the pure parts: normalisation, threads, what is never answered, markup),
``state`` (the cursor, threads and sent record beside the outbox), ``worker`` (the ChannelWorker);
``python -m plugins_app.channel.workers.email`` runs ``__main__``.
"""
KIND = "channel-email"
DESCRIPTION = "Email: IMAP IDLE in, SMTP out; threads by In-Reply-To/References."
ENV_REFS = ("EMAIL_IMAP_HOST", "EMAIL_IMAP_PORT", "EMAIL_IMAP_USER", "EMAIL_IMAP_PASSWORD",
            "EMAIL_SMTP_HOST", "EMAIL_SMTP_PORT")
