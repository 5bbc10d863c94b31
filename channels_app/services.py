"""The one path of a message, and the writes around it.

Every message, from the web API or a channel worker, goes through
`message_submit`: who and where, once only, the hooks before the agent, the
turn, and back out through the event log.
"""
from __future__ import annotations

import hashlib
import json
import logging
import uuid
from urllib.parse import quote
from dataclasses import dataclass, field, replace
from typing import Optional

from django.db import IntegrityError, transaction
from django.utils import timezone

from channels_app import access, auth, file_parts, hooks, questions, statements, voice
from ugent_common import config

from ugent_common import rows
from channels_app.bodies import text_problem
from channels_app.errors import NO_RETRY, ApplicationError
from channels_app.events import event_append
from channels_app.models import (FINAL_STATES, Actor, ApiKey, Caller, CallerDefaults, Conversation, Message,
                                 Receipt, ReceiptState, Role, Turn)

log = logging.getLogger("ugent.hub")

#: The ASGI scope key under which a chat request keeps its accepted turn's id and its conversation's, a pair:
#: from then on no answer to it may invite a retry (the official openai client retries 408, 409, 429 and 5xx),
#: as the turn may already have acted and a resend would run it again, or be refused as a duplicate instead
#: of the real answer; and every answer names both, as a request without conversation_id learns its
#: conversation's id only from the answer.
ACCEPTED_TURN_SCOPE_KEY = "ugent.accepted_turn"


def accepted_turn_headers(turn_id: str, conversation_id: str) -> dict:
    """The headers of an error that answers a chat request after its message was accepted."""
    return {**NO_RETRY, "x-ugent-turn-id": turn_id, "x-ugent-conversation-id": conversation_id}
ACTOR_KEY_MAX = Actor._meta.get_field("key").max_length
NOT_YOURS = "This conversation belongs to another user."
APPLICATION_NAMES_FEDERATED_ONLY = ("An application key may name only federated users of the issuers "
                                    "it lists (federation_issuer with federation_subject).")


# --- who ---------------------------------------------------------------------

VERIFIED_IDENTITY_REQUIRED = ("require_verified_identity is on: a request that names a user must carry an "
                              "identity token from an issuer listed in [[web.auth.issuers]].")
TOKEN_ISSUER_NOT_LISTED_BY_CALLER = ("An application key may name only federated users of the issuers it "
                                     "lists: the identity token's issuer {issuer!r} is not one of them.")


def actor_resolve(*, caller: Caller, user: str | None = None, federation_issuer: str | None = None,
                  federation_subject: str | None = None, identity=None) -> Actor:
    """The end user a request speaks for, by the role rules of "Keys and callers" (docs/identity.md).

    `identity` (a channels_app.federation.VerifiedIdentity) is a verified token's user: it overrides
    any identity in the body, and the actor is `<actor_prefix><sub>`. Without one, an operator names
    anyone; an application names only federated users of the issuers it lists, and only when
    require_verified_identity is off; naming nobody is the operator itself, or `web-user@<caller>`.
    """
    key, defaults = _actor_named(caller=caller, user=user, federation_issuer=federation_issuer,
                                 federation_subject=federation_subject, identity=identity)
    return _get_or_create(Actor, key=key, defaults=defaults)


def actor_existing(*, caller: Caller, user: str | None = None, federation_issuer: str | None = None,
                   federation_subject: str | None = None, identity=None) -> Actor | None:
    """The actor a request names, by actor_resolve's rules and refusals, but never created: None when it has
    no row yet (a request that keeps nothing, dictation: such an actor owns no conversation)."""
    actor = actor_named(caller=caller, user=user, federation_issuer=federation_issuer,
                        federation_subject=federation_subject, identity=identity)
    return actor if actor.pk is not None else None


def actor_named(*, caller: Caller, user: str | None = None, federation_issuer: str | None = None,
                federation_subject: str | None = None, identity=None) -> Actor:
    """The actor a request names, by actor_resolve's rules and refusals, without writing: its row, or while it
    has none an unsaved Actor, which owns nothing (no conversation, receipt or turn has its id). A request
    that keeps something saves it there (actor_kept, in the same transaction); a read or a refusal leaves no
    row behind."""
    key, defaults = _actor_named(caller=caller, user=user, federation_issuer=federation_issuer,
                                 federation_subject=federation_subject, identity=identity)
    return rows.table(Actor).get(key=key) or Actor(key=key, **defaults)


def actor_kept(actor: Actor) -> Actor:
    """An actor_named actor with its row: saved if it had none (or found, if a concurrent request saved it)."""
    if actor.pk is not None:
        return actor
    defaults = {f.name: getattr(actor, f.name) for f in Actor._meta.concrete_fields
                if f.name not in ("id", "key", "created_at", "updated_at")}
    return _get_or_create(Actor, key=actor.key, defaults=defaults)


def _actor_named(*, caller: Caller, user, federation_issuer, federation_subject, identity) -> tuple[str, dict]:
    """The key and row of the actor a request names (actor_resolve's rules; raises its refusals)."""
    is_operator = caller.role == Role.OPERATOR  # anything not exactly an operator gets the application rules
    if identity is not None:
        if not is_operator and identity.issuer not in (caller.issuers or []):
            raise ApplicationError(TOKEN_ISSUER_NOT_LISTED_BY_CALLER.format(issuer=identity.issuer), status=403,
                                   code="actor_not_allowed")
        return identity.actor_key, {"channel": "web", "user_id": identity.subject, "caller": caller,
                                    "federation_issuer": identity.issuer, "federation_subject": identity.subject}
    if bool(federation_issuer) != bool(federation_subject):
        raise ApplicationError("federation_issuer and federation_subject go together.",
                               status=400, code="invalid_request",
                               param="federation_issuer" if not federation_issuer else "federation_subject")
    if not is_operator:
        if user:
            raise ApplicationError(APPLICATION_NAMES_FEDERATED_ONLY, status=403, code="actor_not_allowed",
                                   param="user")
        if federation_issuer and federation_issuer not in (caller.issuers or []):
            raise ApplicationError(APPLICATION_NAMES_FEDERATED_ONLY, status=403, code="actor_not_allowed",
                                   param="federation_issuer")
        if federation_issuer and config.web_auth().require_verified_identity:
            raise ApplicationError(VERIFIED_IDENTITY_REQUIRED, status=403, code="verified_identity_required",
                                   param="federation_subject")
    if federation_issuer:
        # Percent-encoded so that no issuer/subject pair can spell another's key ("a:b" + "c" vs "a" + "b:c").
        key = f"fed:{quote(federation_issuer, safe='')}:{quote(federation_subject, safe='')}"
        if len(key) > ACTOR_KEY_MAX:  # percent-encoding can triple a long non-ASCII pair past the column
            key = "fed#" + hashlib.sha256(json.dumps([federation_issuer, federation_subject]).encode()).hexdigest()
        defaults = {"channel": "web", "user_id": federation_subject, "caller": caller,
                    "federation_issuer": federation_issuer, "federation_subject": federation_subject}
    elif user:
        key = f"web:{user}"
        defaults = {"channel": "web", "user_id": user, "caller": caller}
    elif is_operator:
        key = f"operator@{caller.name}"
        defaults = {"channel": "web", "user_id": key, "caller": caller}
    else:
        key = caller.anonymous_actor_key
        defaults = {"channel": "web", "user_id": key, "caller": caller}
    return key, defaults


def viewer_resolve(*, caller: Caller, user: str | None = None, federation_issuer: str | None = None,
                   federation_subject: str | None = None, identity=None) -> access.Viewer:
    """Whom a request acts for (channels_app.access.Viewer): its caller and the actor it names."""
    actor = actor_resolve(caller=caller, user=user, federation_issuer=federation_issuer,
                          federation_subject=federation_subject, identity=identity)
    return access.Viewer(caller=caller, actor=actor)


def actor_named_of_request(principal, fields: dict) -> Actor:
    """actor_named for a view: the authenticated principal (request.user: caller, verified identity) and the
    identity fields of its body or query (`user`, `federation_issuer`, `federation_subject`). Unsaved while the
    user has no row: what the request keeps saves it (actor_kept) in the same transaction, so a refusal
    leaves none."""
    return actor_named(caller=principal.caller, user=fields.get("user"),
                       federation_issuer=fields.get("federation_issuer"),
                       federation_subject=fields.get("federation_subject"), identity=principal.identity)


def actor_existing_of_request(principal, fields: dict) -> Actor | None:
    """actor_existing for a view, as actor_named_of_request: the same refusals, and None for a user with no row."""
    return actor_existing(caller=principal.caller, user=fields.get("user"),
                          federation_issuer=fields.get("federation_issuer"),
                          federation_subject=fields.get("federation_subject"), identity=principal.identity)


def reader_of_request(principal, fields: dict) -> access.Viewer:
    """The viewer of a request that reads or asks (a stream, a snapshot, a receipt, a file, a stop): the same
    refusals as viewer_resolve, and no Actor row written (actor_named). Only the operator's own actor
    (`operator@<caller>`, one per operator key's caller) is kept, as the operator reads everything."""
    actor = actor_named(caller=principal.caller, user=fields.get("user"),
                        federation_issuer=fields.get("federation_issuer"),
                        federation_subject=fields.get("federation_subject"), identity=principal.identity)
    viewer = access.Viewer(caller=principal.caller, actor=actor)
    return viewer_kept(viewer) if viewer.is_operator else viewer


def viewer_kept(viewer: access.Viewer) -> access.Viewer:
    """A reader_of_request viewer whose actor has its row (actor_kept): for a request that goes on to keep
    something for its user (a stream that follows them), once nothing refused it."""
    if viewer.actor.pk is not None:
        return viewer
    return access.Viewer(caller=viewer.caller, actor=actor_kept(viewer.actor))


def channel_actor_resolve(*, channel: str, user_id: str, display_name: str = "") -> Actor:
    """The actor of a plugin channel's sender: `{channel}:{user_id}`."""
    return _get_or_create(Actor, key=f"{channel}:{user_id}",
                          defaults={"channel": channel, "user_id": user_id, "display_name": display_name})


def _get_or_create(model, defaults, **lookup):
    table = rows.table(model)
    found = table.get(**lookup)
    if found is not None:
        return found
    try:
        with transaction.atomic():
            return table.create(**lookup, **defaults)
    except IntegrityError:  # created concurrently
        return table.get(**lookup)


# --- where -------------------------------------------------------------------

NO_CONVERSATION = "No such conversation."


def conversation_resolve(*, channel: str, client_id: str, external_id: str | None, actor: Actor,
                         caller: Caller | None, create: bool = True) -> tuple[Conversation, bool]:
    """The conversation by its id, created for `actor` on its first message; refused if not theirs.
    `create=False` (a command, which creates no conversation): a missing one is a 404."""
    table = rows.table(Conversation)
    if not external_id and create:  # a new conversation under an id of ours: nobody can hold it yet
        return table.create(channel=channel, client_id=client_id or "", external_id=f"conv-{uuid.uuid4().hex}",
                            owner=actor, caller=caller), True
    lookup = {"channel": channel, "client_id": client_id or "", "external_id": external_id or ""}
    conv = table.get(**lookup)
    created = False
    if conv is None and not create:
        raise ApplicationError(NO_CONVERSATION, status=404, code="conversation_not_found", param="conversation_id")
    if conv is None:
        try:
            with transaction.atomic():
                conv = table.create(**lookup, owner=actor, caller=caller)
                created = True
        except IntegrityError:
            conv = table.get(**lookup)
    conversation_write_check(actor=actor, conversation=conv)
    return conv, created


def conversation_write_check(*, actor: Actor, conversation: Conversation) -> None:
    """Whether `actor` may speak into `conversation` (a message, an upload, dictation, a call): someone
    else's is the seed's 403, "A turn, a question reply or a file on someone else's conversation is refused"."""
    if not access.conversation_writable(actor, conversation):
        raise ApplicationError(NOT_YOURS, status=403, code="conversation_not_owned", param="conversation_id")


def conversation_writable_or_new(*, actor: Actor | None, conversation_id: str, client_id: str = "",
                                 channel: str = "web") -> Conversation | None:
    """The conversation a request that creates none names (dictation, a live call, a question reply), checked as a message into
    it is (conversation_write_check: 403 when someone else's); None while it does not exist yet, as its first
    message will make it this actor's. `actor` None is one with no row yet (actor_existing), who owns none."""
    conv = rows.table(Conversation).get(channel=channel, client_id=client_id or "", external_id=conversation_id)
    if conv is not None and actor is None and conv.channel == "web":
        raise ApplicationError(NOT_YOURS, status=403, code="conversation_not_owned", param="conversation_id")
    if conv is not None and actor is not None:
        conversation_write_check(actor=actor, conversation=conv)
    return conv


# --- the message -------------------------------------------------------------

@dataclass
class Submission:
    """A message on the one path, normalised from the web API or a channel worker."""

    actor: Actor
    text: str
    channel: str = "web"
    caller: Optional[Caller] = None
    api_key_id: Optional[int] = None  # the admin-issued key that sent it (usage per key)
    client_id: str = ""
    conversation_id: Optional[str] = None
    client_message_id: Optional[str] = None
    turn_id: Optional[str] = None
    model: Optional[str] = None
    source_type: str = "user"
    input_mode: Optional[str] = None
    allowed_tools: Optional[list] = None
    denied_tools: Optional[list] = None
    disable_memory_recall: bool = False
    disable_code_context: bool = False
    disable_memory_write: bool = False
    include_thinking: bool = False
    citation_ids: list = field(default_factory=list)
    attachments: list = field(default_factory=list)
    file_ids: list = field(default_factory=list)  # uploaded files its content parts name (POST /v1/files)
    # The sender reads the answer only once it is whole (a non-stream chat request): the turn's first
    # delta need not be written at once, and is coalesced with what follows like every other.
    answer_whole: bool = False
    # The message is an instruction the model must carry out (a translation pipeline's chunk): a model whose
    # engine does not follow prompts (the offline notes engine quotes notes) is refused, not run.
    needs_prompts: bool = False
    extra: dict = field(default_factory=dict)

    def content_hash(self) -> str:
        return content_hash(text=self.text, attachments=self.attachments, input_mode=self.input_mode,
                            file_ids=self.file_ids)


def content_hash(*, text: str, attachments: list | None = None, input_mode: str | None = None,
                 file_ids: list | None = None, interaction_reply: dict | None = None) -> str:
    """What a receipt keeps of a message's content, to tell a repeat from other content under its id."""
    content = {"text": text, "attachments": attachments or [], "input_mode": input_mode}
    if file_ids:  # only then: the hashes of receipts taken before file parts stay the same
        content["files"] = file_ids
    if interaction_reply is not None:  # a question reply: what it answers is its content too
        content["interaction_reply"] = interaction_reply
    payload = json.dumps(content, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class SubmissionResult:
    receipt: Receipt
    turn: Turn
    conversation: Conversation
    stopped: Optional[hooks.HookStop] = None
    queued: bool = False  # the broker could not take the turn: it waits in its row (runner.turns_requeue_lost)


class DuplicateMessage(ApplicationError):
    """A repeat of a client_message_id: refused under the first copy's turn."""

    def __init__(self, message: str, *, code: str, receipt: Receipt, turn: Turn | None):
        extra = {"receipt": receipt_summary(receipt, turn)}
        if turn is not None:
            extra["turn_id"] = turn.turn_id
        headers = {**NO_RETRY, "x-ugent-conversation-id": receipt.conversation.external_id}
        if turn is not None:
            headers["x-ugent-turn-id"] = turn.turn_id
        super().__init__(message, status=409, code=code, param="client_message_id", extra=extra,
                         headers=headers)
        self.receipt = receipt
        self.turn = turn


def receipt_summary(receipt: Receipt, turn: Turn | None = None) -> dict:
    turn = turn if turn is not None else getattr(receipt, "turn", None)
    out = {"conversation_id": receipt.conversation.external_id,
           "client_message_id": receipt.client_message_id,
           "state": receipt.state,
           "turn_id": turn.turn_id if turn else None,
           "created_at": receipt.created_at.isoformat() if receipt.created_at else None,
           "started_at": receipt.started_at.isoformat() if receipt.started_at else None,
           "finished_at": receipt.finished_at.isoformat() if receipt.finished_at else None}
    if receipt.state == ReceiptState.COMPLETED:
        out.update({"answer": receipt.answer, "citations": receipt.citations, "files": receipt.files})
    elif receipt.state in (ReceiptState.REFUSED, ReceiptState.FAILED, ReceiptState.INTERRUPTED,
                           ReceiptState.CANCELLED, ReceiptState.ABANDONED):
        out["reason"] = receipt.reason
        if receipt.answer:
            out["answer"] = receipt.answer
    return out


#: A request's turn_id that a turn already holds. Turn ids are unique across the daemon (a stop may name one
#: exactly), so the request runs nothing; the answer is one and the same whoever's turn holds the id (the
#: sender's own or anyone else's) and says nothing of that turn: not its user, conversation, state or
#: header, only that the id cannot be used (docs/turns.md, "A turn's id").
TURN_ID_UNAVAILABLE = "This turn_id cannot be used: send the turn a new one, one nobody could guess (a UUID)."


def turn_id_unavailable() -> ApplicationError:
    """The refusal of a request whose turn_id a turn already holds (TURN_ID_UNAVAILABLE)."""
    return ApplicationError(TURN_ID_UNAVAILABLE, status=409, code="turn_id_in_use", param="turn_id",
                            headers=NO_RETRY)


def _duplicate(conversation: Conversation, inbound: Submission) -> DuplicateMessage:
    refusal = duplicate_refusal(conversation=conversation, client_message_id=inbound.client_message_id,
                                content_hash=inbound.content_hash())
    if refusal is None:  # the conflict was the turn_id, not the message
        raise turn_id_unavailable()
    return refusal


def duplicate_refusal(*, conversation: Conversation, client_message_id: str,
                      content_hash: str) -> DuplicateMessage | None:
    """How a repeat of a client_message_id is refused, under its first copy (seed 000, "What the chat
    stream sends"); None when the conversation holds no receipt of that id."""
    first = (Receipt.objects.select_related("conversation").filter(
        conversation=conversation, client_message_id=client_message_id).first())
    if first is None:
        return None
    turn = Turn.objects.filter(receipt=first).first()
    if first.content_hash != content_hash:
        return DuplicateMessage("This client_message_id was already used for a different message: "
                                "send it as a new message.", code="DuplicateContentMismatch",
                                receipt=first, turn=turn)
    if first.state in (ReceiptState.FAILED, ReceiptState.INTERRUPTED) and first.started_at:
        return DuplicateMessage(f"The first copy of this message {first.state} after it started and may "
                                "already have acted: send it as a new message.",
                                code="DuplicateAfterFailure", receipt=first, turn=turn)
    if first.state in FINAL_STATES:
        return DuplicateMessage("This message was already processed.", code="DuplicateProcessed",
                                receipt=first, turn=turn)
    return DuplicateMessage("This message is already being processed.", code="DuplicateInFlight",
                            receipt=first, turn=turn)


# --- question replies ----------------------------------------------------------

@dataclass
class ReplyReceipt:
    """The receipt of a question reply sent with a client_message_id: a message like any other to its sender.
    The applied reply is recorded `completed` in the transaction that applies it (questions.question_reply),
    so GET /v1/ugent/receipt finds it, and a repeat runs nothing: refused as a chat message's is."""

    actor: Actor
    client_message_id: str
    content_hash: str

    def _refusal(self, conversation: Conversation) -> DuplicateMessage | None:
        return duplicate_refusal(conversation=conversation, client_message_id=self.client_message_id,
                                 content_hash=self.content_hash)

    def check(self, question) -> None:
        """A repeat (or another message under this id) is refused under its first copy."""
        if statements.receipt_exists(question.conversation_id, self.client_message_id):
            refusal = self._refusal(question.conversation)
            if refusal is not None:
                raise refusal

    def record(self, question) -> None:
        """The receipt, in the reply's transaction; a copy that committed first makes this one a repeat."""
        now = timezone.now()
        try:
            with transaction.atomic():
                rows.table(Receipt).create(
                    conversation=question.conversation, actor=self.actor, client_message_id=self.client_message_id,
                    content_hash=self.content_hash, state=ReceiptState.COMPLETED, started_at=now, finished_at=now,
                    reason=f"a reply to question {question.request_id}")
        except IntegrityError:
            refusal = self._refusal(question.conversation)
            if refusal is None:  # cannot be: the unique constraint is the receipt's
                raise
            raise refusal


def question_reply_submit(*, actor: Actor, reply: dict, content: str = "", conversation: Conversation | None = None,
                          client_message_id: str | None = None) -> dict:
    """A question reply from the chat API (questions.question_reply); with a client_message_id, its receipt
    (ReplyReceipt): a repeat of an applied reply is DuplicateProcessed, other content under the id
    DuplicateContentMismatch, as for any message."""
    receipt = None
    if client_message_id:
        receipt = ReplyReceipt(actor=actor, client_message_id=client_message_id,
                               content_hash=content_hash(text=content, interaction_reply=reply))
    return questions.question_reply(actor=actor, reply=reply, content=content, conversation=conversation,
                                    receipt=receipt)


# --- per-caller defaults -----------------------------------------------------

OPT_OUTS = ("disable_memory_recall", "disable_memory_write", "disable_code_context")


def caller_defaults_apply(*, inbound: Submission) -> Submission:
    """The operator's defaults for the federation issuer the message's actor asserts: their opt-outs
    are added to the request's (a request adds, never switches one back on), and their model runs a
    turn that names none. The effective opt-outs are the turn's own, and every task it starts carries
    them (HookContext.limits). Returns the submission as it will run."""
    issuer = inbound.actor.federation_issuer
    if not issuer:
        return inbound
    defaults = rows.table(CallerDefaults).get(issuer=issuer)
    if defaults is None:
        return inbound
    from dataclasses import replace
    from plugins_app.agent.profiles import DEFAULT_ALIAS
    changes = {name: True for name in OPT_OUTS if getattr(defaults, name)}
    extra = {**inbound.extra, "caller_defaults": issuer}
    if defaults.allowed_tools is not None or defaults.denied_tools:
        from channels_app.tools import limits_merge  # the caller's tools narrow the request's, never widen
        changes["allowed_tools"], changes["denied_tools"] = limits_merge(
            allowed=inbound.allowed_tools, denied=inbound.denied_tools,
            more_allowed=defaults.allowed_tools, more_denied=defaults.denied_tools)
    if defaults.model and (not inbound.model or inbound.model == DEFAULT_ALIAS):
        # below the user's stored /model choice in the seed's order: profile_choose weighs it
        extra["caller_default_model"] = defaults.model
    return replace(inbound, **changes, extra=extra)


def caller_default_model(*, actor: Actor) -> str:
    """The model the per-caller defaults give the issuer this actor asserts ("" when none)."""
    if not actor.federation_issuer:
        return ""
    defaults = rows.table(CallerDefaults).get(issuer=actor.federation_issuer)
    return defaults.model if defaults is not None else ""


MODEL_CANNOT_FOLLOW_PROMPTS = ("The model '{name}' does not follow instructions (it answers by quoting the notes), "
                               "so it cannot do what this channel asks: make a model that does the default "
                               "(UGENT_LLM_BASE_URL, or the admin's agent profiles), or choose one for the sender "
                               "with /model.")


def _needs_a_model_that_follows_prompts(profile) -> None:
    from plugins_app.agent.engines.registry import profile_follows_prompts
    try:
        follows = profile_follows_prompts(profile)
    except LookupError:
        return  # (the turn says its engine is not installed)
    if not follows:
        raise ApplicationError(MODEL_CANNOT_FOLLOW_PROMPTS.format(name=profile.name), status=400,
                               code="model_cannot_follow_prompts", param="model")


#: A client_message_id at least this long (a UUID is 36) is taken as unique to its sender, not to one conversation.
MESSAGE_KEY_UNIQUE_LENGTH = 16


def conversation_id_of_message(inbound: Submission) -> str:
    """The conversation of a message that names none but carries an idempotency key unique to its sender (at
    least MESSAGE_KEY_UNIQUE_LENGTH characters): derived from its sender and that key, so a resend (the client
    never learnt the id, its first answer lost) lands in the same conversation and is the duplicate the seed
    answers, not a second turn. A shorter key ("1", "msg-1") is read as a counter within a conversation, which
    a client may start again in its next new conversation: such a message, like one without a key, starts a
    conversation of its own (conversation_resolve)."""
    seed = "\x1f".join((inbound.channel, inbound.client_id or "", inbound.actor.key, inbound.client_message_id))
    return f"conv-{hashlib.sha256(seed.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def message_submit(*, inbound: Submission, profile=None, on_turn=None) -> SubmissionResult:
    """Accept one message: receipt once only, hooks before the agent, then the turn (a Celery task).

    Raises ApplicationError (403 not theirs, 409 duplicate, 400 bad model) having changed nothing:
    the conversation a first message creates is created in the same transaction as its receipt.
    `on_turn(turn)` is called with a new turn before its transaction commits, so before any of its
    events can be published or its task run (the chat API subscribes to the turn's wake-ups there).
    """
    problem = text_problem(inbound.text)
    if problem is not None:  # the web API refuses it earlier; a channel worker's text is checked here
        raise ApplicationError(f"The message content {problem}", status=400, code="invalid_content",
                               param="content")
    inbound = caller_defaults_apply(inbound=inbound)
    if not inbound.conversation_id and len(inbound.client_message_id or "") >= MESSAGE_KEY_UNIQUE_LENGTH:
        inbound = replace(inbound, conversation_id=conversation_id_of_message(inbound))
    try:
        with transaction.atomic():
            if inbound.actor.pk is None:  # a sender's first message: their row comes and goes with it
                inbound = replace(inbound, actor=actor_kept(inbound.actor))
            conversation, created = conversation_resolve(
                channel=inbound.channel, client_id=inbound.client_id, external_id=inbound.conversation_id,
                actor=inbound.actor, caller=inbound.caller)
            if inbound.client_message_id and statements.receipt_exists(conversation.pk, inbound.client_message_id):
                raise _duplicate(conversation, inbound)
            file_parts.files_for_submission(actor=inbound.actor, conversation=conversation,
                                            file_ids=inbound.file_ids)
            if profile is None:
                from plugins_app.agent.profiles import profile_resolve
                profile = profile_resolve(requested=inbound.model, actor=inbound.actor, conversation=conversation,
                                          caller=inbound.caller,
                                          caller_default=inbound.extra.get("caller_default_model", ""))
            if inbound.needs_prompts:
                _needs_a_model_that_follows_prompts(profile)
            if inbound.turn_id and rows.table(Turn).get(turn_id=inbound.turn_id) is not None:
                raise turn_id_unavailable()
            return _submit_locked(inbound, conversation, created, profile, on_turn)
    except IntegrityError:
        # a concurrent request committed first (a copy of this message, or a turn with this turn_id)
        conversation = Conversation.objects.filter(
            channel=inbound.channel, client_id=inbound.client_id or "",
            external_id=inbound.conversation_id or "").first()
        if conversation is None:  # only the turn_id can have collided
            raise turn_id_unavailable()
        # our rollback may have let another sender's first message make it theirs: the 403 they would have
        # given us had they come first, never their receipt (tests/channels_app/test_message_race.py)
        conversation_write_check(actor=inbound.actor, conversation=conversation)
        raise _duplicate(conversation, inbound)


def _submit_locked(inbound: Submission, conversation: Conversation, created: bool, profile,
                   on_turn=None) -> SubmissionResult:
    receipt = rows.table(Receipt).create(
        conversation=conversation, actor=inbound.actor,
        client_message_id=inbound.client_message_id or f"msg-{uuid.uuid4().hex}",
        content_hash=inbound.content_hash())
    ctx = hooks.HookContext(
        text=inbound.text, channel=inbound.channel, source_type=inbound.source_type,
        user_id=inbound.actor.user_id, conversation_id=conversation.external_id,
        input_mode=inbound.input_mode, actor_key=inbound.actor.key, conversation=conversation,
        actor=inbound.actor, receipt=receipt, is_first_message=created,
        allowed_tools=inbound.allowed_tools,
        limits={"disable_memory_recall": inbound.disable_memory_recall,
                "disable_code_context": inbound.disable_code_context,
                "disable_memory_write": inbound.disable_memory_write,
                "allowed_tools": inbound.allowed_tools, "denied_tools": inbound.denied_tools})
    unheard = voice.unheard_answer(input_mode=inbound.input_mode, text=inbound.text, file_ids=inbound.file_ids,
                                   profile=profile)
    if unheard is not None:  # answered with why, before routing and without a model call
        stop = hooks.HookStop(unheard, state="refused", reason=voice.UNHEARD_REASON, decided_by="voice")
    else:
        stop = hooks.run_before_agent_turn(ctx)
    action = None
    if isinstance(stop, hooks.NativeAction):
        # The turn runs it, after this transaction commits: an action may take seconds (a summariser's
        # model call) and must not hold the receipt's transaction, the write lock in embedded mode.
        action = {"action": stop.action, "decided_by": stop.decided_by, "reason": stop.reason,
                  "first_message": created}  # the runner has no HookContext: what the action reads of it
        stop = None
    turn = rows.table(Turn).create(
        turn_id=inbound.turn_id or f"turn-{uuid.uuid4().hex}", conversation=conversation,
        actor=inbound.actor, receipt=receipt, model=profile.name if profile else "",
        profile=profile, allowed_tools=ctx.allowed_tools, denied_tools=inbound.denied_tools,
        caller=inbound.caller, api_key_id=inbound.api_key_id,
        disable_memory_recall=inbound.disable_memory_recall,
        disable_code_context=inbound.disable_code_context,
        disable_memory_write=inbound.disable_memory_write, input_mode=inbound.input_mode or "",
        include_thinking=inbound.include_thinking, citation_ids=inbound.citation_ids,
        context={"tags": ctx.tags, "injected_context": ctx.injected_context, "text": ctx.text,
                 **({"files": list(inbound.file_ids)} if inbound.file_ids else {}),
                 **({"delegate_research": ctx.delegate_research} if ctx.delegate_research else {}),
                 **({"caller_defaults": inbound.extra["caller_defaults"]}
                    if inbound.extra.get("caller_defaults") else {}),
                 **({"answer_whole": True} if inbound.answer_whole else {}),
                 **({"native_action": action} if action else {})})
    result = SubmissionResult(receipt=receipt, turn=turn, conversation=conversation, stopped=stop)
    if stop is None:
        from channels_app.dispatch import turn_dispatch

        def dispatch():
            result.queued = not turn_dispatch(turn.pk)
        # Registered before the event append's wake-ups, so it runs first at the commit: in servers mode
        # a worker takes the turn while this process still publishes them (bench/servers_timeline.py).
        # (With Celery's eager mode, tests and `cron run`, the whole turn runs here first: its readers
        # find the accept's wake-up late and read the log, which holds everything.)
        transaction.on_commit(dispatch)
    # the user's message goes in the event append's round trip
    message = rows.table(Message).insert_step(conversation=conversation, role=Message.Role.USER,
                                              content=inbound.text, actor=inbound.actor, turn=turn)
    user_event = {"turn_id": turn.turn_id, "client_message_id": receipt.client_message_id,
                  "content": inbound.text, "role": "user", "actor": inbound.actor.key}
    if inbound.input_mode:
        user_event["input_mode"] = inbound.input_mode
    event_append(conversation_id=conversation.id, turn_pk=turn.pk, type="ugent.user_message",
                 data=user_event, new_turn=True, before=[message])
    if on_turn is not None:
        on_turn(turn)
    if stop is not None:
        turn_finish_without_agent(turn=turn, stop=stop)
    return result


def turn_finish_without_agent(*, turn: Turn, stop: hooks.HookStop) -> None:
    """A hook stopped the message: answer the sender, record it like any other turn (runner.turn_end).
    A native action's turn is recorded the same way by the runner (TurnRun.native_action_run)."""
    from channels_app.models import TurnState
    from channels_app.runner import turn_end
    state = stop.state if stop.state in (ReceiptState.COMPLETED, ReceiptState.REFUSED) else ReceiptState.COMPLETED
    turn_end(turn=turn, state=state, answer=stop.answer, reason=stop.reason, from_state=TurnState.ACCEPTED,
             started_at=timezone.now(), decided_by=stop.decided_by,
             pending=[("turn.delta", {"turn_id": turn.turn_id, "segment": "answer", "text": stop.answer}, [])])


# --- reads -------------------------------------------------------------------

def receipt_get(*, viewer: access.Viewer, conversation_id: str, client_message_id: str,
                client_id: str = "", channel: str = "web") -> dict:
    """A receipt for its sender or the operator itself; 404 to anyone else, as for a missing one.
    An operator key naming a user is that user here, as everywhere (channels_app.access)."""
    receipt = (Receipt.objects.select_related("conversation", "actor")
               .filter(conversation__channel=channel, conversation__client_id=client_id or "",
                       conversation__external_id=conversation_id, client_message_id=client_message_id)
               .first())
    if receipt is None or not access.receipt_readable(viewer, receipt):
        raise ApplicationError("No such message.", status=404, code="receipt_not_found")
    return receipt_summary(receipt)


# --- keys ----------------------------------------------------------------------

def api_key_issue(*, caller: Caller, label: str = "issued in the admin") -> tuple[ApiKey, str]:
    """A new key for a caller; only its hash is kept, so the raw key is returned once, to be shown once."""
    raw = ApiKey.generate()
    key = ApiKey(caller=caller, label=label)
    key.set_key(raw)
    key.save()
    return key, raw


def api_key_revoke(*, key_pk: int) -> bool:
    """Take a key out of use: the next request that presents it is refused, and a stream it opened ends.
    False if it was not active."""
    revoked = ApiKey.objects.filter(pk=key_pk, active=True).update(active=False, updated_at=timezone.now()) == 1
    if revoked:
        auth.credentials_changed_for(*ApiKey.objects.filter(pk=key_pk).values_list("caller_id", flat=True))
    return revoked


@transaction.atomic
def api_key_rotate(*, key_pk: int) -> tuple[ApiKey, str] | None:
    """Replace an active key: a new key for the same caller and label, the old one revoked in the same
    transaction. Returns (new key, raw key) once; None if the key was not active (nothing changes)."""
    old = ApiKey.objects.select_for_update().select_related("caller").filter(pk=key_pk, active=True).first()
    if old is None:
        return None
    ApiKey.objects.filter(pk=old.pk).update(active=False, updated_at=timezone.now())
    auth.credentials_changed_for(old.caller_id)  # after the commit
    return api_key_issue(caller=old.caller, label=old.label or "rotated in the admin")
