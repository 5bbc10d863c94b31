"""Who may read or act on what: one access check per object type.

Every view and service asks here, and nowhere else, whether the party a
request acts for may touch an object. The party is a `Viewer`: the caller that
authenticated (its key) and the actor it acts for (channels_app.services
.viewer_resolve applies the role rules of "Keys and callers"). The key's role
alone decides nothing about data: an operator key that names `bob` is bob, and
sees what bob sees. Only an operator key that names nobody is the operator
itself (`Viewer.is_operator`), which sees every conversation and event.

| object | who may | otherwise |
|---|---|---|
| conversation (read: streams, snapshots, history) | its owner, the operator | 404, as a missing one |
| conversation (write: a message into it) | its owner; on a plugin channel, any sender | 403 |
| receipt | its sender, the operator | 404, as a missing one |
| file (download) | its conversation's owner, the operator | 404, as a missing one |
| file (upload, or a file part of a turn) | its conversation's owner (the write rule) | 403 / 400 |
| event | the operator; the conversation's owner when addressed to all or to them | not sent |
| turn, stop | its own user, the operator, or anyone naming its exact turn_id | 404 |
| turn, steering | its own user, the operator (any of their clients, by turn_id or not) | 404 |
| the host's paths (/sandbox) | an operator key, whomever it names | shown relative to the workspace |

Steering is words put into another person's turn, so an exact turn_id lets a
stranger stop a turn (the seed: "a stop needs the turn's own user, the
operator, or the exact turn_id it stops") but never steer it.

The checks are plain functions of a viewer and an object's rows, with no
request, key or HTTP in them, so the plugin bridge can use them for its own
traffic: a channel worker's sender is `Viewer(caller=None, actor=<the
{channel}:{user_id} actor>)` (`channel_viewer`), never an operator, and the
bridge asks `conversation_writable` before a submit and `receipt_readable`
before answering for a message, as the web views do. A check for an object the
bridge alone holds (a delivery, a claim) belongs beside these, taking the same
viewer, so each object type still has one.
"""
from __future__ import annotations

from dataclasses import dataclass

from channels_app.models import Actor, Caller, Conversation, File, Receipt, Role, Turn


@dataclass(frozen=True)
class Viewer:
    """Whom a request acts for: the caller whose key it carries and the actor it speaks for."""

    caller: Caller | None
    actor: Actor

    @property
    def is_operator(self) -> bool:
        """The operator itself: an operator key that names nobody (its actor is `operator@<caller>`)."""
        return (self.caller is not None and self.caller.role == Role.OPERATOR
                and self.actor.key == f"operator@{self.caller.name}")


def channel_viewer(actor: Actor) -> Viewer:
    """A plugin channel's sender, as the bridge acts for it: no key, never the operator."""
    return Viewer(caller=None, actor=actor)


# --- conversations -----------------------------------------------------------

def conversation_readable(viewer: Viewer, conversation: Conversation) -> bool:
    """Streams, snapshots and history of a conversation: its owner and the operator."""
    return viewer.is_operator or conversation.owner_id == viewer.actor.id


def conversation_writable(actor: Actor, conversation: Conversation) -> bool:
    """A message into a conversation. A plugin channel's conversation is the chat itself (a group has
    many senders; the plugin's allowed_senders decides who may write); on the web channel it belongs
    to its first sender, and nobody else writes into it, the operator acting as itself included."""
    return conversation.channel != "web" or conversation.owner_id == actor.id


# --- receipts ----------------------------------------------------------------

def receipt_readable(viewer: Viewer, receipt: Receipt) -> bool:
    """Where one message stands: its sender and the operator (the seed)."""
    return viewer.is_operator or receipt.actor_id == viewer.actor.id


def receipts_scope(viewer: Viewer, queryset):
    """The receipts of a queryset this viewer may read (a conversation snapshot's list)."""
    return queryset if viewer.is_operator else queryset.filter(actor_id=viewer.actor.id)


# --- files -------------------------------------------------------------------

def file_readable(viewer: Viewer, file: File) -> bool:
    """A /v1/files/<id> link: its conversation's owner and the operator (the seed: "File links last")."""
    return conversation_readable(viewer, file.conversation)


def file_attachable(actor: Actor, file: File, conversation: Conversation) -> bool:
    """A file part of a chat turn: a file of the same conversation, uploaded by the turn's own user."""
    return file.conversation_id == conversation.id and file.actor_id == actor.id


# --- events ------------------------------------------------------------------

def event_readable(viewer: Viewer, *, owner_id: int, audience: list) -> bool:
    """One event of the log, by its conversation's owner and its audience (actor keys; [] is everyone)."""
    if viewer.is_operator:
        return True
    return owner_id == viewer.actor.id and (not audience or viewer.actor.key in audience)


def events_scope(viewer: Viewer, queryset):
    """The all-conversations stream's rows before the per-event audience check: the conversations the
    viewer owns (the operator: all)."""
    return queryset if viewer.is_operator else queryset.filter(conversation__owner_id=viewer.actor.id)


# --- the host ----------------------------------------------------------------

def host_paths_readable(viewer: Viewer) -> bool:
    """The host's paths (the workspace root, the sandbox's writable paths, a working directory as a path):
    an operator key, whomever it names, as the operator's host endpoints answer (channels_app.auth.IsOperator).
    Anyone else (an application key, a chat channel's sender) is shown them relative to the workspace."""
    return viewer.caller is not None and viewer.caller.role == Role.OPERATOR


# --- turns -------------------------------------------------------------------

def turn_is_theirs(viewer: Viewer, turn: Turn) -> bool:
    """The turn's own user, or the operator."""
    return viewer.is_operator or turn.actor_id == viewer.actor.id


def turn_stoppable(viewer: Viewer, turn: Turn, *, by_exact_turn_id: bool) -> bool:
    """A stop: the turn's own user, the operator, or anyone naming its exact turn_id."""
    return by_exact_turn_id or turn_is_theirs(viewer, turn)


def turn_steerable(viewer: Viewer, turn: Turn) -> bool:
    """A steering: the turn's own user or the operator only, whatever id it names."""
    return turn_is_theirs(viewer, turn)
