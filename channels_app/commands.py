"""Slash commands a channel may run (POST /v1/ugent/commands): /model, /models, /recall, /steering,
/btw, /harness, /refine, /sandbox and /compress. Anything else is answered as unsupported.

A command speaks for the same actor, and reaches a conversation through the same resolution and
access check, as a chat message does (services.actor_resolve, services.conversation_resolve), but
it creates no conversation and puts nothing into its history: a command is not a turn. Commands
that change something (storing /model, /harness edits, /steering, /compress) need the caller's
allow_remote_control (Caller.remote_control_allowed); read-only ones are always allowed.

A chat channel's sender runs the same commands by typing them (plugins_app.channel.services, through
`channel_command` and `command_dispatch`): there the plugin's `allow_remote_control` senders may change
things, and /sandbox, which shows how the host's sandbox is set up, counts as a change. Its host paths
go to an operator key alone (access.host_paths_readable); anyone else reads them relative to the workspace.
docs/commands.md describes each.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from channels_app import access, compaction, harness, sandbox, services, streams
from channels_app.access import Viewer
from channels_app.errors import ApplicationError
from channels_app.models import Actor, Conversation, HarnessKind, HarnessState, Message
from ugent_common import bounded

SUPPORTED = ("/model", "/models", "/recall", "/steering", "/btw", "/harness", "/refine", "/sandbox", "/compress")
SUPPORTED_TEXT = ", ".join(SUPPORTED)
UNSUPPORTED = "{name} is not a command here. The supported commands are: " + SUPPORTED_TEXT + "."
NOT_A_COMMAND = 'A command starts with "/", e.g. "/model". The supported commands are: ' + SUPPORTED_TEXT + "."
REMOTE_CONTROL_REFUSED = ("{name} changes things, which needs allow_remote_control: this caller does not have it. "
                          "Read-only commands ({read_only}) are always allowed.")
READ_ONLY = "/model, /models, /recall, /btw, /harness, /refine, /sandbox"
#: On a chat channel the plugin's allow_remote_control names the senders who may change things; /sandbox, which
#: shows how the host's sandbox is set up, is theirs too (an open bot's strangers have no business with it).
CHANNEL_REMOTE_CONTROL_REFUSED = ("{name} changes things, which needs allow_remote_control: this sender does not "
                                  "have it. Read-only commands ({read_only}) are always allowed.")
CHANNEL_READ_ONLY = "/model, /models, /recall, /btw, /harness, /refine"
#: Commands that ask the engine (seconds, up to UGENT_COMMAND_ENGINE_TIMEOUT): on a chat channel they are
#: answered from a task, not while the worker's submit waits (plugins_app.channel.services._command_take).
ENGINE_COMMANDS = ("/btw", "/refine", "/compress")  # (/compress: the summariser may be a model)
NEEDS_CONVERSATION = "{name} needs a conversation_id: the conversation it acts on."
NEEDS_TEXT = "Say what {what}: {usage}."
NOTHING_TO_REFINE = "There is no message of yours in this conversation to refine."
ENGINE_OVERRUN = ("{count} earlier questions to this engine are still running past their time limit: it is not "
                  "asked again until they end.")
NO_MEMORY = "No memory backend is configured here: recall finds nothing, and nothing would be injected."
CLEAR_WORDS = ("default", "ugent-default", "clear", "reset")
HARNESS_SUBCOMMANDS = ("list", "goal TEXT", "task TEXT", "check ID phrase:TEXT|file:PATH", "done ID", "drop ID",
                       "reopen ID", "verify [ID]")
HARNESS_UNKNOWN = ("Unknown /harness subcommand {sub!r}. The subcommands are: "
                   + ", ".join(f"/harness {s}" for s in HARNESS_SUBCOMMANDS) + ".")
SOURCE_WORDS = {"user": "your stored /model choice", "conversation": "this conversation's stored choice",
                "caller_defaults": "the per-caller defaults of your issuer", "caller": "the caller's default model",
                "global": "the global default (UGENT_DEFAULT_MODEL)", "default_profile": "the default profile"}
BTW_PROMPT = ("The user asks a side question. Answer it briefly from what you know and the conversation so far; "
              "the question and your answer stay out of the conversation.")
REFINE_PROMPT = ("Rewrite the user's message below into a clearer, self-contained prompt for an AI assistant. "
                 "Keep its meaning and language; add nothing it does not ask. Answer with the rewritten prompt only.")


@dataclass
class CommandContext:
    viewer: Viewer
    name: str
    args: str
    conversation: Conversation | None
    client_id: str
    turn_id: str | None
    remote_control: bool = False  # may change things (the caller's, or a channel sender's allow_remote_control)
    channel: bool = False  # typed on a chat channel (not POST /v1/ugent/commands)


def _result(ctx: CommandContext, text: str, *, data: dict | None = None, changed: bool = False,
            ok: bool = True, unsupported: bool = False) -> dict:
    return {"object": "ugent.command", "command": ctx.name, "ok": ok, "unsupported": unsupported,
            "changed": changed, "text": text, "data": data or {},
            "conversation_id": ctx.conversation.external_id if ctx.conversation is not None else None}


def _refuse(message: str, *, status: int = 400, code: str = "invalid_command") -> ApplicationError:
    return ApplicationError(message, status=status, code=code, param="command")


def command_parse(text: str) -> tuple[str, str]:
    """(name, args) of a command's text: `/model gpt-x` is ("/model", "gpt-x"); a 400 if it is no command."""
    stripped = text.strip()
    if not stripped.startswith("/") or len(stripped) < 2 or stripped[1].isspace():
        raise _refuse(NOT_A_COMMAND)
    name, _, args = stripped.partition(" ")
    if "\n" in name:
        name, _, rest = name.partition("\n")
        args = rest + (" " + args if args else "")
    return name.lower(), args.strip()


def command_run(*, viewer: Viewer, command: str, conversation_id: str | None = None, client_id: str = "",
                turn_id: str | None = None) -> dict:
    """Run one command for `viewer`; its answer ({object, command, ok, unsupported, changed, text, data})."""
    name, args = command_parse(command)
    conversation = None
    if conversation_id:
        # the chat path's resolution and check: a stranger's conversation is a 403, as a message into it is
        conversation, _ = services.conversation_resolve(channel="web", client_id=client_id, external_id=conversation_id,
                                                        actor=viewer.actor, caller=viewer.caller, create=False)
    caller = viewer.caller
    ctx = CommandContext(viewer=viewer, name=name, args=args, conversation=conversation, client_id=client_id,
                         turn_id=turn_id, remote_control=caller is not None and caller.remote_control_allowed)
    handler = HANDLERS.get(name)
    if handler is None:
        return _result(ctx, UNSUPPORTED.format(name=name[:100]), ok=False, unsupported=True,
                       data={"supported": list(SUPPORTED)})
    return handler(ctx)


def channel_command(text: str) -> tuple[str, str] | None:
    """(name, args) when a chat message is one of the commands here, else None: it goes to the model as text.
    Text that merely starts with a slash (``/etc/hosts is empty``, a platform's own ``/start``) is no command
    here, nor is Telegram's ``/model@other_bot`` (the worker strips its own bot's name from a command
    addressed to it)."""
    if not text.lstrip().startswith("/"):
        return None
    try:
        name, args = command_parse(text)
    except ApplicationError:
        return None
    return (name, args) if name in HANDLERS else None


def command_dispatch(*, viewer: Viewer, name: str, args: str, conversation: Conversation,
                     remote_control: bool) -> dict:
    """A command a chat channel's sender typed (``channel_command``'s answer), run in that chat's
    conversation; ``remote_control``: the sender is one of the plugin's allow_remote_control."""
    ctx = CommandContext(viewer=viewer, name=name, args=args, conversation=conversation,
                         client_id=conversation.client_id, turn_id=None, remote_control=remote_control, channel=True)
    if name == "/sandbox":
        _needs_remote_control(ctx)
    return HANDLERS[name](ctx)


def _needs_remote_control(ctx: CommandContext) -> None:
    if ctx.remote_control:
        return
    refused, read_only = ((CHANNEL_REMOTE_CONTROL_REFUSED, CHANNEL_READ_ONLY) if ctx.channel
                          else (REMOTE_CONTROL_REFUSED, READ_ONLY))
    raise ApplicationError(refused.format(name=ctx.name, read_only=read_only), status=403,
                           code="remote_control_not_allowed", param="command")


def _needs_conversation(ctx: CommandContext) -> Conversation:
    if ctx.conversation is None:
        raise ApplicationError(NEEDS_CONVERSATION.format(name=ctx.name), status=400, code="invalid_request",
                               param="conversation_id")
    return ctx.conversation


# --- /model and /models --------------------------------------------------------------------------

def _model_now(ctx: CommandContext, actor: Actor) -> tuple[str, str]:
    from plugins_app.agent.profiles import profile_choose
    profile, source = profile_choose(requested=None, actor=actor, conversation=ctx.conversation,
                                     caller=ctx.viewer.caller,
                                     caller_default=services.caller_default_model(actor=actor))
    return profile.name, source


def _actor_now(ctx: CommandContext) -> Actor:
    """The command's actor as it stands now (its stored /model choice); one with no row yet as it is (unsaved,
    no choice): a command that only reads or is refused writes no row."""
    actor = ctx.viewer.actor
    return actor if actor.pk is None else Actor.objects.get(pk=actor.pk)


def command_model(ctx: CommandContext) -> dict:
    from plugins_app.agent.profiles import DEFAULT_ALIAS, model_not_available, profile_named
    actor = _actor_now(ctx)
    if not ctx.args:
        model, source = _model_now(ctx, actor)
        return _result(ctx, f"Model: {model} (from {SOURCE_WORDS[source]}).",
                       data={"model": model, "source": source, "stored": actor.model_choice or None})
    name = ctx.args
    _needs_remote_control(ctx)
    if name.lower() in CLEAR_WORDS or name == DEFAULT_ALIAS:
        changed = Actor.objects.filter(pk=actor.pk).exclude(model_choice="").update(model_choice="") == 1
        actor.model_choice = ""
        model, source = _model_now(ctx, actor)
        return _result(ctx, f"Your stored model choice is cleared: your turns now run {model} "
                            f"(from {SOURCE_WORDS[source]}).",
                       data={"model": model, "source": source, "stored": None}, changed=changed)
    profile = profile_named(name)
    if profile is None:
        raise model_not_available(name)
    actor = services.actor_kept(actor)  # the choice is stored on the user's row: its first store makes it
    changed = Actor.objects.filter(pk=actor.pk).exclude(model_choice=name).update(model_choice=name) == 1
    return _result(ctx, f"Your model is now {name}: it runs your turns that name no model (or ugent-default).",
                   data={"model": profile.name, "source": "user", "stored": name}, changed=changed)


def command_models(ctx: CommandContext) -> dict:
    from plugins_app.agent.profiles import models_list
    models = models_list()
    lines = "\n".join(f"- {m['id']}" for m in models)
    return _result(ctx, f"The models you may name:\n{lines}" if models else "No model is available here.",
                   data={"models": models})


# --- /recall -------------------------------------------------------------------------------------

def _last_user_text(conversation: Conversation, actor: Actor) -> str:
    return (Message.objects.filter(conversation=conversation, role=Message.Role.USER, actor=actor)
            .order_by("-id").values_list("content", flat=True).first()) or ""


def command_recall(ctx: CommandContext) -> dict:
    from plugins_app.agent.memory import recall_preview
    text = ctx.args or (_last_user_text(ctx.conversation, ctx.viewer.actor) if ctx.conversation else "")
    if not text:
        raise _refuse(NEEDS_TEXT.format(what="to recall for", usage="/recall TEXT, or name a conversation "
                                                                    "with a message of yours in it"))
    preview = recall_preview(actor_key=ctx.viewer.actor.key, text=text)
    facts = preview.get("facts") or []
    if preview.get("backend") is None:
        words = NO_MEMORY
    elif not facts:
        words = f"Memory ({preview['backend']}) recalls nothing for this."
    else:
        words = f"Memory ({preview['backend']}) would inject {len(facts)} fact(s), about " \
                f"{preview.get('tokens_est', 0)} tokens:\n" + "\n".join(f"- {f.get('text', '')}" for f in facts)
    return _result(ctx, words, data={"backend": preview.get("backend"), "facts": facts,
                                     "tokens_est": preview.get("tokens_est", 0), "query": text})


# --- /steering -----------------------------------------------------------------------------------

def command_steering(ctx: CommandContext) -> dict:
    if not ctx.args:
        raise _refuse(NEEDS_TEXT.format(what="steers the turn", usage="/steering TEXT"))
    conversation = _needs_conversation(ctx)
    _needs_remote_control(ctx)
    turn = streams.turn_for_action(viewer=ctx.viewer, conversation_id=conversation.external_id,
                                   client_id=conversation.client_id, channel=conversation.channel,
                                   turn_id=ctx.turn_id, action=streams.STEER)
    steering, _new = streams.turn_steer(viewer=ctx.viewer, turn=turn, message=ctx.args)
    return _result(ctx, f"Steering queued for turn {turn.turn_id}: the engine reads it before its next step.",
                   data={"steering_id": steering.id, "turn_id": turn.turn_id, "state": steering.state},
                   changed=True)


# --- the engine, asked aside (/btw, /refine) ------------------------------------------------------

def _profile_for(ctx: CommandContext):
    from plugins_app.agent.profiles import profile_choose
    actor = _actor_now(ctx)
    return profile_choose(requested=None, actor=actor, conversation=ctx.conversation, caller=ctx.viewer.caller,
                          caller_default=services.caller_default_model(actor=actor))[0]


def engine_ask(profile, messages: list[tuple[str, str]]) -> str:
    """The engine's answer to `messages` ((role, text) pairs), asked outside any turn and any session the
    conversation has: nothing is written. Raises EngineError (or the engine's own error) when it fails."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

    from plugins_app.agent.engines.base import ANSWER, ANSWER_RESET, ERROR, EngineError, stream_items
    from plugins_app.agent.engines.registry import engine_for_profile
    timeout = settings.UGENT_COMMAND_ENGINE_TIMEOUT
    deadline = time.monotonic() + timeout

    def ask() -> str:
        try:
            engine = engine_for_profile(profile)  # (a new version of the profile starts its engine: bounded too)
        except LookupError as exc:
            raise EngineError(str(exc), code="engine_not_installed")
        answer: list[str] = []
        for item in stream_items(engine, [AgentMessage(role=MessageRole(r), content=t) for r, t in messages],
                                 session_id=f"aside-{uuid.uuid4().hex}", tools=None,
                                 should_stop=lambda: time.monotonic() > deadline):
            if item.kind == ANSWER:
                answer.append(item.text)
            elif item.kind == ANSWER_RESET:
                answer.clear()
            elif item.kind == ERROR:
                raise EngineError(item.text or "The engine reported an error.")
            if time.monotonic() > deadline:
                raise EngineError("The engine ran out of time.", code="time_limit")
        return "".join(answer).strip()

    # On a thread of its own: an engine that never returns would otherwise keep the request's thread (the
    # API's, or the plugin bridge's) for ever. Past its time limit it is answered at once and counts against
    # the engine until it ends; at UGENT_TURN_STUCK_MAX such asks the engine is not asked again until then.
    done = bounded.call_bounded(ask, timeout=timeout, owner=f"engine:{profile.name}",
                                limit=settings.UGENT_TURN_STUCK_MAX, name="ugent-ask")
    if done.refused:
        raise EngineError(ENGINE_OVERRUN.format(count=done.refused), code="engine_busy")
    if done.timed_out:
        raise EngineError("The engine ran out of time.", code="time_limit")
    if done.error is not None:
        raise done.error
    return done.value


def _history(conversation: Conversation | None, limit: int) -> list[tuple[str, str]]:
    if conversation is None:
        return []
    rows = list(Message.objects.filter(conversation=conversation, hidden=False)
                .exclude(role=Message.Role.SYSTEM).order_by("-id").values_list("role", "content")[:limit])
    rows.reverse()
    return rows


def command_btw(ctx: CommandContext) -> dict:
    if not ctx.args:
        raise _refuse(NEEDS_TEXT.format(what="you want to ask", usage="/btw QUESTION"))
    profile = _profile_for(ctx)
    messages = [("system", BTW_PROMPT)] + _history(ctx.conversation, profile.history_turns) + [("user", ctx.args)]
    try:
        answer = engine_ask(profile, messages)
    except Exception as exc:  # an engine's failure is the answer's, never the request's
        why = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        return _result(ctx, f"The engine could not answer: {why}", ok=False,
                       data={"model": profile.name, "answer": None, "error": why})
    return _result(ctx, answer, data={"model": profile.name, "answer": answer, "question": ctx.args})


FILLERS = re.compile(r"^(?:(?:um+|uh+|so|ok(?:ay)?|hey|hi|well)[,.!]?\s+)+", re.IGNORECASE)
QUESTION_WORDS = ("what", "why", "how", "when", "where", "who", "which", "can", "could", "would", "should",
                  "is", "are", "do", "does", "did", "will")


def refine_offline(text: str) -> str:
    """A clearer prompt without an engine: whitespace tidied, leading fillers dropped, the first letter
    capitalised, and a question mark or full stop to end it."""
    out = re.sub(r"[ \t]+", " ", text.strip())
    out = re.sub(r"\n{3,}", "\n\n", out)
    out = FILLERS.sub("", out).strip() or text.strip()
    if out and out[0].islower():
        out = out[0].upper() + out[1:]
    if out and out[-1] not in ".?!:;)\"'`":
        first = out.split(" ", 1)[0].lower()
        out += "?" if first in QUESTION_WORDS else "."
    return out


def _follows_prompts(profile) -> bool:
    from plugins_app.agent.engines.registry import profile_follows_prompts
    try:
        return profile_follows_prompts(profile)
    except LookupError:
        return True  # (engine_ask says it is not installed)


def command_refine(ctx: CommandContext) -> dict:
    conversation = _needs_conversation(ctx)
    original = _last_user_text(conversation, ctx.viewer.actor)
    if not original:
        raise _refuse(NOTHING_TO_REFINE, code="nothing_to_refine")
    profile = _profile_for(ctx)
    via, refined, why = "engine", "", None
    if _follows_prompts(profile):  # (the offline notes engine would answer with a quote of the notes)
        try:
            refined = engine_ask(profile, [("system", REFINE_PROMPT), ("user", original)])
        except Exception as exc:  # the offline rewrite stands in
            why = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
    if not refined:
        via, refined = "offline", refine_offline(original)
    data = {"original": original, "refined": refined, "via": via, "model": profile.name if via == "engine" else None}
    if why:
        data["engine_error"] = why
    return _result(ctx, f"A clearer prompt (send it as a new message if it says what you meant):\n\n{refined}",
                   data=data)


# --- /sandbox ------------------------------------------------------------------------------------

def command_sandbox(ctx: CommandContext) -> dict:
    description = sandbox.sandbox_describe(conversation=ctx.conversation,
                                           host_paths=access.host_paths_readable(ctx.viewer))
    return _result(ctx, sandbox.sandbox_text(description), data=description)


# --- /compress -----------------------------------------------------------------------------------

def command_compress(ctx: CommandContext) -> dict:
    """Compact the conversation now (channels_app.compaction): what compact_conversation answers."""
    conversation = _needs_conversation(ctx)
    _needs_remote_control(ctx)
    try:
        done = compaction.conversation_compact(conversation=conversation, trigger=compaction.COMMAND)
    except compaction.CompactionFailed as exc:
        return _result(ctx, compaction.COMPACT_FAILED, ok=False, data={"compacted": False, "error": str(exc)})
    return _result(ctx, done.text, changed=done.compacted,
                   data={"compacted": done.compacted, "hidden": done.hidden, "kept": done.kept,
                         "summary_message_id": done.summary_id, "summarizer": done.summarizer or None})


# --- /harness ------------------------------------------------------------------------------------

def _harness_text(items: list[dict]) -> str:
    if not items:
        return "No goals or tasks yet: add one with /harness goal TEXT or /harness task TEXT."
    lines = []
    for i in items:
        v = i["verification"]
        check = f" — check {i['check']}" if i["check"] else ""
        verified = "" if v is None else f" — {'passed' if v['passed'] else 'failed'}: {v['detail']}"
        lines.append(f"#{i['id']} {i['kind']} [{i['state']}] {i['text']}{check}{verified}")
    return "\n".join(lines)


def command_harness(ctx: CommandContext) -> dict:
    conversation = _needs_conversation(ctx)
    sub, _, rest = ctx.args.partition(" ")
    sub, rest = sub.lower(), rest.strip()
    if sub in ("", "list", "show"):
        items = harness.harness_items(conversation=conversation)
        return _result(ctx, _harness_text(items), data={"items": items})
    if sub not in ("goal", "task", "check", "done", "drop", "reopen", "verify"):
        raise _refuse(HARNESS_UNKNOWN.format(sub=sub[:100]))
    _needs_remote_control(ctx)
    actor = ctx.viewer.actor
    if sub in (HarnessKind.GOAL, HarnessKind.TASK):
        item = harness.item_add(conversation=conversation, actor=actor, kind=sub, text=rest)
        text = f"Added {sub} #{item.pk}: {item.text}"
        changed = True
    elif sub == "check":
        raw_id, _, spec = rest.partition(" ")
        item = harness.item_get(conversation=conversation, raw_id=raw_id)
        harness.item_check_set(item=item, spec=spec)
        text, changed = f"#{item.pk} is verified by {item.check_spec}.", True
    elif sub == "verify":
        item = harness.item_get(conversation=conversation, raw_id=rest) if rest else None
        done = harness.items_verify(conversation=conversation, item=item)
        text = ("\n".join(f"#{v.item_id} {'passed' if v.passed else 'failed'}: {v.detail}" for v in done)
                or "Nothing to verify: no open goal or task has a check.")
        changed = bool(done)
    else:
        item = harness.item_get(conversation=conversation, raw_id=rest)
        state = {"done": HarnessState.DONE, "drop": HarnessState.DROPPED, "reopen": HarnessState.OPEN}[sub]
        changed = harness.item_state_set(item=item, state=state)
        text = f"#{item.pk} is {state}." if changed else f"#{item.pk} was already {state}."
    items = harness.harness_items(conversation=conversation)
    return _result(ctx, text, data={"items": items}, changed=changed)


HANDLERS = {"/model": command_model, "/models": command_models, "/recall": command_recall,
            "/steering": command_steering, "/btw": command_btw, "/harness": command_harness,
            "/refine": command_refine, "/sandbox": command_sandbox, "/compress": command_compress}
