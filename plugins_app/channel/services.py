"""Writes of the plugins room: plugin state, secrets, inbound messages and the outbound queue.

An inbound message from a worker goes onto the one message path
(``channels_app.services.message_submit``); the turn's answer comes back as an
``OutboundDelivery`` row created inside the transaction that records the turn's
end (``delivery_create_for_turn``, an after-turn hook), so nothing is lost
between the turn and the queue. A question the turn asks on the way comes as a delivery of its own
(``delivery_create_for_question``, a question-asked hook), and the sender's next message may be
its reply (``channels_app.questions.question_reply_from_channel``); a slash command the sender types is run
and answered by a delivery of its own (``_command_take``). Deliveries move by conditional updates:
pending -> in_flight (a claim) -> delivered | pending (retry) | dead_letter.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import logging
import uuid
from typing import Iterable

from django.db import IntegrityError, connection, transaction
from django.db.models import F, Sum
from django.utils import timezone

from channels_app import notify
from plugins_app.channel import conf
from plugins_app.channel.bridge.policy import DeliveryPolicy, new_claim
from plugins_app.channel.models import DeliveryState, OutboundDelivery, Plugin, PluginMedia, PluginSecret, PluginState
from plugins_app.channel.secrets import secret_encrypt

log = logging.getLogger("ugent.plugins")

SENDER_NOT_ALLOWED = "sender not allowed"
ANSWER_FOR_STATE = {
    "failed": "Sorry, the agent could not answer this message.",
    "cancelled": "The answer to this message was stopped.",
    "interrupted": "The answer to this message was interrupted.",
}


def outbound_topic(plugin_id: str) -> str:
    """The notify topic a plugin's long-poll waits on."""
    return f"plugin-outbound:{plugin_id}"


def _wake_after_commit(plugin_id: str) -> None:
    transaction.on_commit(lambda: notify.publish(outbound_topic(plugin_id)))


# --- plugins ------------------------------------------------------------------------------

def plugin_state_record(*, plugin_id: str, state: str, reason: str, pid: int | None = None) -> None:
    """What the supervisor saw; the circuit breaker's `disabled` also turns `enabled` off, with the reason."""
    fields = {"state": state, "state_reason": reason[:500], "pid": pid if state == PluginState.RUNNING else None}
    if state in (PluginState.BACKOFF, PluginState.COOLDOWN):  # the worker died and is to be started again
        fields["restarts"] = F("restarts") + 1
    if state == PluginState.DISABLED:
        fields.update(enabled=False, disabled_reason=reason)
    Plugin.objects.filter(plugin_id=plugin_id).update(**fields, updated_at=timezone.now())


def plugin_enable(*, plugin: Plugin) -> bool:
    """Enable a plugin again (after the circuit breaker): the supervisor starts it with a clean breaker."""
    return Plugin.objects.filter(pk=plugin.pk).update(
        enabled=True, disabled_reason="", state=PluginState.STOPPED, state_reason="",
        updated_at=timezone.now()) == 1


def plugin_disable(*, plugin: Plugin) -> bool:
    """The operator turns a plugin off: the supervisor stops its worker on its next step."""
    return Plugin.objects.filter(pk=plugin.pk, enabled=True).update(enabled=False, updated_at=timezone.now()) == 1


def plugin_heartbeat_record(*, plugin_id: str, at: dt.datetime | None = None) -> None:
    Plugin.objects.filter(plugin_id=plugin_id).update(last_heartbeat=at or timezone.now())


def plugin_secret_set(*, plugin: Plugin, name: str, value: str) -> PluginSecret:
    """Store (or replace) one secret_env_refs value, encrypted; adds the name to secret_env_refs."""
    secret, _ = PluginSecret.objects.update_or_create(plugin=plugin, name=name,
                                                      defaults={"ciphertext": secret_encrypt(value)})
    if name not in (plugin.secret_env_refs or []):
        plugin.secret_env_refs = list(plugin.secret_env_refs or []) + [name]
        plugin.save(update_fields=["secret_env_refs", "updated_at"])
    return secret


def plugin_secret_delete(*, plugin: Plugin, name: str) -> None:
    PluginSecret.objects.filter(plugin=plugin, name=name).delete()


# --- inbound ------------------------------------------------------------------------------

def sender_allowed(plugin: Plugin, sender_id: str) -> bool:
    """`allowed_senders` as `{channel}:{sender_id}` entries; empty (or "*") lets everyone in."""
    allowed = list(plugin.allowed_senders or [])
    if not allowed or "*" in allowed:
        return True
    return f"{plugin.channel}:{sender_id}" in allowed


def sender_may_remote_control(plugin: Plugin, sender_id: str) -> bool:
    """`allow_remote_control` as `{channel}:{sender_id}` entries, "*" for every allowed sender; empty: nobody."""
    senders = list(plugin.allow_remote_control or [])
    return "*" in senders or f"{plugin.channel}:{sender_id}" in senders


#: Channels whose every message is an instruction for the model to carry out, not a question (the translation
#: pipeline's chunks): a model that does not follow prompts refuses them (channels_app.services.Submission).
INSTRUCTION_CHANNELS = frozenset({"translate"})


def inbound_submit(*, plugin_id: str, message) -> dict:
    """One normalised inbound message (an SDK ``InboundMessage``) onto the one message path.

    Refuses a sender outside ``allowed_senders`` before anything is recorded; a
    repeat of the channel's message id in the same conversation runs nothing and
    answers ``duplicate: true``. A slash command (``/model``, ``/recall``...) is run,
    not sent to the model. Returns the ``inbound.submit`` result.
    """
    from channels_app.commands import channel_command
    from channels_app.errors import ApplicationError
    from channels_app.services import (DuplicateMessage, Submission, channel_actor_resolve,
                                       message_submit)
    plugin = Plugin.objects.filter(plugin_id=plugin_id).first()
    if plugin is None:
        return {"accepted": False, "duplicate": False, "reason": "plugin not registered"}
    channel = plugin.channel
    if message.channel != channel:
        log.info("plugin %s: message names channel %r; using the plugin's channel %r",
                 plugin_id, message.channel, channel)
    if not sender_allowed(plugin, message.sender_id):
        log.warning("plugin %s refused inbound message %s from %s:%s (reason=%s)", plugin_id,
                    message.message_id, channel, message.sender_id, "not in allowed_senders")
        return {"accepted": False, "duplicate": False, "reason": SENDER_NOT_ALLOWED}
    actor = channel_actor_resolve(channel=channel, user_id=message.sender_id,
                                  display_name=message.sender_name or "")
    inbound = Submission(
        actor=actor, text=message.text, channel=channel, caller=None, client_id=plugin.plugin_id,
        conversation_id=message.conversation_id, client_message_id=message.message_id,
        source_type=message.source_type, attachments=[a.to_dict() for a in message.attachments],
        extra={"timestamp": message.timestamp, "sender_name": message.sender_name,
               "reply_to": message.reply_to.to_dict() if message.reply_to else None,
               "metadata": message.metadata},
        needs_prompts=channel in INSTRUCTION_CHANNELS)
    command = None if message.attachments else channel_command(message.text or "")
    if command is not None:
        return _command_take(plugin=plugin, actor=actor, message=message, command=command)
    taken = _question_reply_take(plugin=plugin, actor=actor, message=message, content_hash=inbound.content_hash())
    if taken is not None:
        return {"accepted": True, "duplicate": False, "question": taken.request_id, "reply": taken.outcome,
                "question_state": taken.state}
    try:
        result = message_submit(inbound=inbound)
    except DuplicateMessage as exc:
        return {"accepted": True, "duplicate": True, "code": exc.code,
                "turn_id": exc.turn.turn_id if exc.turn else None, "receipt_state": exc.receipt.state}
    except ApplicationError as exc:
        log.warning("plugin %s: inbound message %s refused (reason=%s)", plugin_id, message.message_id,
                    exc.message)
        return {"accepted": False, "duplicate": False, "reason": exc.message, "code": exc.code}
    return {"accepted": True, "duplicate": False, "turn_id": result.turn.turn_id,
            "receipt_state": result.receipt.state}


def command_delivery_id(*, plugin_id: str, conversation_id: str, message_id: str) -> str:
    """A typed command's one answer, named by the message: the channel sending it again finds the first."""
    digest = hashlib.sha256(f"{plugin_id}\0{conversation_id}\0{message_id}".encode()).hexdigest()[:40]
    return f"d_cmd_{digest}"


#: What a held command answer says when its task never filled it in (the engine's time and a margin passed).
COMMAND_NOT_ANSWERED = "The engine did not answer this in time."
COMMAND_HOLD_MARGIN_SECS = 30.0


def _command_run(*, actor, conversation, name: str, args: str, remote_control: bool) -> tuple[str, bool, bool]:
    """(text, ok, changed) of one typed command; a refusal is the command's answer, in the chat."""
    from channels_app.access import channel_viewer
    from channels_app.commands import command_dispatch
    from channels_app.errors import ApplicationError
    try:
        result = command_dispatch(viewer=channel_viewer(actor), name=name, args=args, conversation=conversation,
                                  remote_control=remote_control)
        return result["text"], result["ok"], result["changed"]
    except ApplicationError as exc:
        return exc.message, False, False


def _command_take(*, plugin: Plugin, actor, message, command: tuple[str, str]) -> dict:
    """Run a command the sender typed in the chat's conversation and queue its answer, once per message id.

    A command is no turn: no Receipt, Turn or Message row, so the answer's delivery (named by the message,
    ``command_delivery_id``) is what marks it done. A repeat of the message finds it and runs nothing. Two
    copies racing each other may both run the command (its effects are set-to-a-value, except a /harness
    goal or task added twice), but only one answer is queued.

    A command that asks the engine (/btw, /refine: up to UGENT_COMMAND_ENGINE_TIMEOUT) would outlast the
    worker's submit call, which would send it again and hold the chat's later messages behind it. Its
    delivery is queued at once, held (``not_before``) and saying ``COMMAND_NOT_ANSWERED``, and a task
    (``plugins_app.tasks.channel_command_answer``) runs it and puts the answer in while the hold lasts. A
    task lost with its worker is run again (acks late); one that never comes leaves that sentence to go out."""
    from django.conf import settings

    from channels_app.commands import ENGINE_COMMANDS
    from channels_app.errors import ApplicationError
    from channels_app.services import conversation_resolve
    from ugent_common.tasks import task_named
    name, args = command
    delivery_id = command_delivery_id(plugin_id=plugin.plugin_id, conversation_id=message.conversation_id,
                                      message_id=message.message_id)
    if OutboundDelivery.objects.filter(delivery_id=delivery_id).exists():
        return {"accepted": True, "duplicate": True, "command": name}
    try:
        conversation, _ = conversation_resolve(channel=plugin.channel, client_id=plugin.plugin_id,
                                               external_id=message.conversation_id, actor=actor, caller=None)
    except ApplicationError as exc:
        return {"accepted": False, "duplicate": False, "reason": exc.message, "code": exc.code}
    remote_control = sender_may_remote_control(plugin, message.sender_id)
    held = name in ENGINE_COMMANDS
    if held:
        text, ok, changed = COMMAND_NOT_ANSWERED, False, False
    else:
        text, ok, changed = _command_run(actor=actor, conversation=conversation, name=name, args=args,
                                         remote_control=remote_control)
    log.info("plugin %s: %s:%s %s %s in %s (ok=%s, changed=%s)", plugin.plugin_id, plugin.channel,
             message.sender_id, "asked" if held else "ran", name, message.conversation_id, ok, changed)
    metadata = {"kind": "command", "command": name, "ok": ok, "changed": changed}
    try:
        with transaction.atomic():
            delivery = delivery_enqueue(plugin=plugin, conversation=conversation, text=text, delivery_id=delivery_id,
                                        reply_to_message_id=message.message_id, metadata=metadata)
            if held:
                hold = timezone.now() + dt.timedelta(seconds=settings.UGENT_COMMAND_ENGINE_TIMEOUT
                                                     + COMMAND_HOLD_MARGIN_SECS)
                OutboundDelivery.objects.filter(pk=delivery.pk).update(not_before=hold)
                actor_id, conversation_pk = actor.pk, conversation.pk
                transaction.on_commit(lambda: task_named("plugins_app.tasks.channel_command_answer").delay(
                    delivery_id, name, args, actor_id, conversation_pk, remote_control))
    except IntegrityError:  # the same message run at once elsewhere: that answer is the one
        return {"accepted": True, "duplicate": True, "command": name}
    return {"accepted": True, "duplicate": False, "command": name, "ok": ok}


def command_answer_fill(*, delivery_id: str, name: str, args: str, actor_id: int, conversation_id: int,
                        remote_control: bool) -> bool:
    """The task's half of a held command (``_command_take``): run it and put its answer into the delivery
    while that is still held; False when the hold had passed (its placeholder went out) or it was filled."""
    from django.conf import settings

    from channels_app.models import Actor, Conversation

    def held():  # never handed out (a placeholder gone out, even once, stays what went out), the hold not over
        return OutboundDelivery.objects.filter(delivery_id=delivery_id, state=DeliveryState.PENDING, handed_out=0,
                                               not_before__gt=timezone.now(), text=COMMAND_NOT_ANSWERED)
    # the time the task waited in the queue is not the engine's: its hold starts again now
    if not held().update(not_before=timezone.now() + dt.timedelta(
            seconds=settings.UGENT_COMMAND_ENGINE_TIMEOUT + COMMAND_HOLD_MARGIN_SECS)):
        return False
    actor = Actor.objects.get(pk=actor_id)
    conversation = Conversation.objects.get(pk=conversation_id)
    text, ok, changed = _command_run(actor=actor, conversation=conversation, name=name, args=args,
                                     remote_control=remote_control)
    row = held().first()
    if row is None:
        return False
    payload = dict(row.payload or {})
    payload["metadata"] = {**payload.get("metadata", {}), "ok": ok, "changed": changed}
    with transaction.atomic():
        filled = held().update(text=text or COMMAND_NOT_ANSWERED, payload=payload, not_before=None) == 1
        if filled:
            _wake_after_commit(row.plugin.plugin_id)
    return filled


def _question_reply_take(*, plugin: Plugin, actor, message, content_hash: str):
    """The message as the reply to the question waiting for its sender (a button press names it by the
    option's ``value``, sent back as ``metadata["option"]``), its notice queued in the transaction that
    records the reply; None when it is no reply and goes on as a message. No transaction is open here:
    the reply is read by the option matcher or the yes/no engine (plugins, bounded) before
    ``question_reply_from_channel`` opens its own."""
    from channels_app.models import Conversation
    from channels_app.questions import question_reply_from_channel
    conversation = Conversation.objects.filter(channel=plugin.channel, client_id=plugin.plugin_id,
                                               external_id=message.conversation_id).first()
    if conversation is None:
        return None
    option = (message.metadata or {}).get("option")

    def notice(taken) -> None:
        if taken.notice:
            delivery_enqueue(plugin=plugin, conversation=conversation, text=taken.notice,
                             reply_to_message_id=message.message_id,
                             metadata={"kind": "question_notice", "request_id": taken.request_id,
                                       "reply": taken.outcome, "question_state": taken.state})
    return question_reply_from_channel(actor=actor, conversation=conversation, client_message_id=message.message_id,
                                       content_hash=content_hash, text=message.text or "",
                                       option=option if isinstance(option, str) else None, on_taken=notice)


# --- outbound -----------------------------------------------------------------------------

def _new_delivery_id() -> str:
    return f"d_{uuid.uuid4().hex}"


def delivery_enqueue(*, plugin: Plugin, conversation, text: str, turn=None, attachments: list | None = None,
                     reply_to_message_id: str | None = None, metadata: dict | None = None,
                     delivery_id: str | None = None) -> OutboundDelivery:
    """Queue a message for a plugin's worker to send; its poller wakes when this commits. A ``delivery_id``
    given names it (an IntegrityError when it is taken)."""
    payload = {"attachments": list(attachments or []), "metadata": dict(metadata or {})}
    if reply_to_message_id:
        payload["reply_to_message_id"] = reply_to_message_id
    with transaction.atomic():
        delivery = OutboundDelivery.objects.create(delivery_id=delivery_id or _new_delivery_id(), plugin=plugin,
                                                   conversation=conversation, turn=turn, text=text,
                                                   payload=payload)
        _wake_after_commit(plugin.plugin_id)
    return delivery


def delivery_create_for_turn(*, turn, state: str, answer: str) -> None:
    """After-turn hook: a turn of a plugin's conversation queues its answer for that plugin.

    Runs inside the transaction that records the turn's end, so the answer and
    its delivery commit together. A second call for the same turn adds nothing.
    """
    conversation = turn.conversation
    plugin = _plugin_of(conversation)
    if plugin is None:
        return
    if OutboundDelivery.objects.filter(plugin=plugin, turn=turn).exists():
        return
    notice = ANSWER_FOR_STATE.get(state, "")
    # A turn that ended otherwise after part of its answer had streamed (its process killed mid-turn, a stop, a
    # failure) keeps that part as its answer: sent alone, a chat would show it as the whole answer. The notice
    # follows it, as it stands alone for a turn that said nothing.
    text = f"{answer}\n\n{notice}" if answer and notice else (answer or notice)
    if not text:
        return
    receipt = turn.receipt
    delivery_enqueue(plugin=plugin, conversation=conversation, turn=turn, text=text,
                     reply_to_message_id=receipt.client_message_id,
                     metadata={"turn_id": turn.turn_id, "state": state})


def _plugin_of(conversation) -> Plugin | None:
    """The plugin whose conversation this is (its client_id), if it still serves that channel."""
    if not conversation.client_id:
        return None
    plugin = Plugin.objects.filter(plugin_id=conversation.client_id).first()
    if plugin is None or plugin.channel != conversation.channel:
        return None
    return plugin


def question_delivery_id(request_id: str) -> str:
    """A question's one delivery, named by the question: a second hand-out of it finds the first."""
    return f"d_{request_id}"


def delivery_create_for_question(*, question) -> OutboundDelivery | None:
    """Question-asked hook: a question a turn of a plugin's conversation asks is queued for that plugin.

    Runs inside the transaction that records the question. Its own delivery, not the turn's (the
    turn's answer keeps its one slot per turn), named by the question's request_id, so a second
    call adds nothing. ``text`` is the question with its options numbered; ``metadata["options"]``
    the buttons ({id, label, value}: a press sends ``value`` back as ``metadata["option"]``).
    Nothing a reply holds is in it (a secret's delivery is its prompt)."""
    from channels_app.questions import question_channel_options, question_channel_text
    turn = question.turn
    conversation = turn.conversation
    plugin = _plugin_of(conversation)
    if plugin is None:
        return None
    delivery_id = question_delivery_id(question.request_id)
    existing = OutboundDelivery.objects.filter(delivery_id=delivery_id).first()
    if existing is not None:
        return existing
    spec = question.spec or {}
    metadata = {"kind": "question", "request_id": question.request_id, "turn_id": turn.turn_id,
                "question_kind": question.kind, "question_id": spec.get("id", ""),
                "timeout_at": question.timeout_at.isoformat().replace("+00:00", "Z"),
                "options": question_channel_options(question)}
    payload = {"attachments": [], "metadata": metadata, "reply_to_message_id": turn.receipt.client_message_id}
    try:
        with transaction.atomic():
            delivery = OutboundDelivery.objects.create(delivery_id=delivery_id, plugin=plugin,
                                                       conversation=conversation, turn=None,
                                                       text=question_channel_text(question), payload=payload)
            _wake_after_commit(plugin.plugin_id)
    except IntegrityError:  # the same question handed out at once elsewhere: that copy is the one
        return OutboundDelivery.objects.filter(delivery_id=delivery_id).first()
    return delivery


def deliveries_claim(*, plugin_id: str, max_items: int) -> list[OutboundDelivery]:
    """Take up to ``max_items`` due deliveries, never letting more than max_in_flight be unacknowledged.

    The plugin row is locked for the count and the take (PostgreSQL; SQLite's
    IMMEDIATE transactions already serialise writers), and the take is a
    conditional update, so two pollers can never hold more than the limit.
    """
    now = timezone.now()
    with transaction.atomic():
        plugin = Plugin.objects.select_for_update().filter(plugin_id=plugin_id).first()
        if plugin is None:
            return []
        in_flight = OutboundDelivery.objects.filter(plugin=plugin, state=DeliveryState.IN_FLIGHT).count()
        room = delivery_policy(plugin).room(in_flight=in_flight, max_items=max_items)
        if room <= 0:
            return []
        due = (OutboundDelivery.objects.filter(plugin=plugin, state=DeliveryState.PENDING)
               .exclude(not_before__gt=now).order_by("id"))
        if connection.features.has_select_for_update_skip_locked:
            due = due.select_for_update(skip_locked=True)
        ids = list(due.values_list("pk", flat=True)[:room])
        if not ids:
            return []
        claim = new_claim()
        from django.db.models import F
        OutboundDelivery.objects.filter(pk__in=ids, state=DeliveryState.PENDING).update(
            state=DeliveryState.IN_FLIGHT, claim=claim, handed_out_at=now, handed_out=F("handed_out") + 1)
        # by the plugin too: claim has no index, (plugin, state, id) has, and without it every take read
        # every delivery ever made
        return list(OutboundDelivery.objects.filter(plugin=plugin, state=DeliveryState.IN_FLIGHT, claim=claim)
                    .select_related("conversation", "plugin").order_by("id"))


def deliveries_requeue(*, plugin_id: str, delivery_ids: Iterable[str] | None = None) -> int:
    """Back to the queue, unchanged (same attempt, same place): all in flight, or the ones named."""
    rows = OutboundDelivery.objects.filter(plugin__plugin_id=plugin_id, state=DeliveryState.IN_FLIGHT)
    if delivery_ids is not None:
        rows = rows.filter(delivery_id__in=list(delivery_ids))
    with transaction.atomic():
        count = rows.update(state=DeliveryState.PENDING, claim="")
        if count:
            _wake_after_commit(plugin_id)
    return count


class UnknownDeliveryId(LookupError):
    pass


def delivery_policy(plugin: Plugin) -> DeliveryPolicy:
    """The plugin's limits and the host's retry backoff, as the one delivery policy both hubs keep."""
    return DeliveryPolicy(max_in_flight=plugin.max_in_flight, max_retries=plugin.max_retries,
                          backoff_secs=conf.RETRY_BACKOFF_SECS, backoff_max_secs=conf.RETRY_BACKOFF_MAX_SECS)


def delivery_ack(*, plugin_id: str, delivery_id: str, status: str, retryable: bool = False,
                 reason: str | None = None, channel_message_id: str | None = None,
                 claim: str | None = None) -> dict:
    """Settle a delivery as ``plugins_app.channel.bridge.policy.DeliveryPolicy.ack`` decides: delivered is
    final; a failure is retried with attempt + 1 until the plugin's max_retries are used, then
    dead-lettered with the reason (a permanent one at once). A repeated ack of a settled delivery,
    or a failure under a claim that no longer holds it (a replaced session's late ack), is
    ``duplicate: true`` and changes nothing. ``claim`` None: a trusted direct call."""
    now = timezone.now()
    with transaction.atomic():
        d = (OutboundDelivery.objects.select_for_update().select_related("plugin")
             .filter(plugin__plugin_id=plugin_id, delivery_id=delivery_id).first())
        if d is None:
            raise UnknownDeliveryId(delivery_id)
        base = d.attempt_base  # the retry budget counts from the operator's last requeue
        decision = delivery_policy(d.plugin).ack(state=d.state, attempt=d.attempt - base, held_claim=d.claim,
                                                 status=status, retryable=retryable, reason=reason,
                                                 claim=claim)
        if not decision.changed:
            return {**decision.result(), "attempt": decision.attempt + base}
        fields = {"state": decision.state, "attempt": decision.attempt + base, "claim": "", "updated_at": now}
        if decision.state == DeliveryState.DELIVERED:
            fields.update(delivered_at=now, channel_message_id=channel_message_id or "")
        if decision.failure is not None:
            fields["failures"] = list(d.failures or []) + [decision.failure]
            fields["last_error"] = decision.dead_letter_reason or decision.failure
        if decision.backoff_secs is not None:
            fields["not_before"] = now + dt.timedelta(seconds=decision.backoff_secs)
        # conditional on the state read under the lock: two acks cannot both settle it
        moved = OutboundDelivery.objects.filter(pk=d.pk, state=d.state).update(**fields)
        if not moved:
            d.refresh_from_db()
            return {"state": d.state, "attempt": d.attempt, "duplicate": True}
        _wake_after_commit(plugin_id)
        if decision.state == DeliveryState.DEAD_LETTER:
            log.warning("plugin %s: delivery %s dead-lettered (reason=%s)", plugin_id, delivery_id,
                        fields["last_error"])
        return {**decision.result(), "attempt": fields["attempt"]}


def delivery_retry(*, delivery: OutboundDelivery) -> bool:
    """Admin: send a dead letter again, with its whole retry budget. Its attempt number goes on from the last
    one (the worker's outbox acks a failure it recorded again for an attempt it has seen, and sends only a
    higher one: a requeue at attempt 1 was never sent); the budget counts from here (attempt_base)."""
    with transaction.atomic():
        moved = OutboundDelivery.objects.filter(pk=delivery.pk, state=DeliveryState.DEAD_LETTER).update(
            state=DeliveryState.PENDING, attempt=F("attempt") + 1, attempt_base=F("attempt"), not_before=None,
            last_error="", updated_at=timezone.now())
        if moved:
            _wake_after_commit(delivery.plugin.plugin_id)
    return moved == 1


#: Deliveries a prune may delete: settled for good. Pending and in-flight ones are still to be sent,
#: and a dead letter waits for the operator (retry or discard).
SETTLED_STATES = (DeliveryState.DELIVERED, DeliveryState.DISCARDED)
PRUNE_BATCH = 1000


def deliveries_prune(*, now: dt.datetime | None = None) -> int:
    """Delete deliveries settled more than UGENT_PLUGIN_DELIVERY_RETENTION_SECS ago (each row keeps the
    answer's text). In batches, each its own transaction, so the write lock is never held for long.
    A turn's delivery is gone only long after the turn ended, when its end cannot be recorded again."""
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=conf.DELIVERY_RETENTION_SECS)
    deleted = 0
    while True:
        ids = list(OutboundDelivery.objects.filter(state__in=SETTLED_STATES, updated_at__lt=cutoff)
                   .values_list("pk", flat=True)[:PRUNE_BATCH])
        if not ids:
            return deleted
        deleted += OutboundDelivery.objects.filter(pk__in=ids, state__in=SETTLED_STATES).delete()[0]


def delivery_discard(*, delivery: OutboundDelivery) -> bool:
    """Admin: give up on a dead letter for good; it stays on record as discarded and is never sent."""
    return OutboundDelivery.objects.filter(pk=delivery.pk, state=DeliveryState.DEAD_LETTER).update(
        state=DeliveryState.DISCARDED, updated_at=timezone.now()) == 1


# --- media --------------------------------------------------------------------------------

class MediaTooLargeError(ValueError):
    """Over the per-file limit, or (``quota`` set) over what is left of the plugin's quota: ``limit`` is
    then the room left, the largest file the host takes from that plugin now."""

    def __init__(self, size: int, limit: int, *, quota: int | None = None, stored: int | None = None):
        if quota is None:
            super().__init__(f"{size} bytes is over the limit of {limit}")
        else:
            super().__init__(f"{size} bytes is over the {limit} bytes left of the plugin's media quota "
                             f"of {quota} ({stored} stored)")
        self.size, self.limit, self.quota, self.stored = size, limit, quota, stored


def media_store(*, plugin_id: str, data: bytes, content_type: str, filename: str | None = None) -> str:
    """Store a worker's file for UGENT_PLUGIN_MEDIA_TTL_SECS. Refused (``MediaTooLargeError``, nothing
    stored) over UGENT_PLUGIN_MEDIA_MAX_BYTES, or when the plugin's media not yet expired would pass
    UGENT_PLUGIN_MEDIA_QUOTA_BYTES with it."""
    if len(data) > conf.MEDIA_MAX_BYTES:
        raise MediaTooLargeError(len(data), conf.MEDIA_MAX_BYTES)
    with transaction.atomic():
        # The plugin's row lock makes its puts one at a time, so two cannot both fit in the same room.
        plugin = Plugin.objects.select_for_update(no_key=True).get(plugin_id=plugin_id)
        now = timezone.now()
        stored = PluginMedia.objects.filter(plugin=plugin, expires_at__gte=now).aggregate(
            total=Sum("size"))["total"] or 0
        if stored + len(data) > conf.MEDIA_QUOTA_BYTES:
            raise MediaTooLargeError(len(data), max(0, conf.MEDIA_QUOTA_BYTES - stored),
                                     quota=conf.MEDIA_QUOTA_BYTES, stored=stored)
        media_id = f"m_{uuid.uuid4().hex}"
        PluginMedia.objects.create(media_id=media_id, plugin=plugin, content_type=content_type,
                                   filename=filename or "", size=len(data), data=bytes(data),
                                   expires_at=now + dt.timedelta(seconds=conf.MEDIA_TTL_SECS))
    return media_id


def media_prune() -> int:
    count, _ = PluginMedia.objects.filter(expires_at__lt=timezone.now()).delete()
    return count
