"""Voice in this build: what can hear a voice message, and the answer to one nothing can.

A voice message (`ugent_input_mode: "voice"` with a recording as a file part) is transcribed before
routing where a transcription engine is installed, or handed as audio to a model that takes audio (a
MultimodalChatEngine profile). This build installs no transcription engine, so only such a model can
use a recording; a voice message with no words of its own whose model cannot hear it is answered with
why, without a model call, and routing never sees it (the spec: "A voice message nothing can use is
answered with why, without a model call"). `GET /v1/ugent/status`'s `media.voice.input` says the same
before a client offers a microphone.
"""
from __future__ import annotations

from channels_app import access
from channels_app.errors import ApplicationError
from channels_app.models import File, Turn, TurnState

#: The answer to a voice message nothing here can hear ({model}: the conversation's model).
UNHEARD_ANSWER = ("This voice message cannot be heard here: no transcription engine is installed and the "
                  "model {model} takes no audio. Type the message instead.")
UNHEARD_REASON = "voice message unheard: no transcription engine, and the model takes no audio"
TRANSCRIPTION_AVAILABLE = False  # no speech-to-text engine ships in this build


def audio_models() -> list[str]:
    """The profiles whose engine takes audio itself (status.media.voice.input.native_models)."""
    from plugins_app.agent.engines.registry import profile_hears_audio
    from plugins_app.agent.models import AgentProfile
    out = []
    for profile in AgentProfile.objects.order_by("name"):
        try:
            if profile_hears_audio(profile):
                out.append(profile.name)
        except LookupError:
            continue  # its engine is not installed: it hears nothing
    return out


def voice_input_status() -> dict:
    """status.media.voice.input: voice messages can be used for the models listed, dictation nowhere."""
    models = audio_models()
    out = {"available": bool(models), "transcription": TRANSCRIPTION_AVAILABLE, "dictation": False,
           "native_models": models}
    if not models:
        out["reason"] = "no_engine"
    return out


def unheard_answer(*, input_mode: str | None, text: str, file_ids: list, profile) -> str | None:
    """The answer to this message when it is a voice message nothing can hear; None otherwise (its own
    words, if any, are what the turn reads, as a transcript would be)."""
    if input_mode != "voice" or (text or "").strip() or not file_ids or TRANSCRIPTION_AVAILABLE:
        return None
    if not File.objects.filter(file_id__in=list(file_ids), mime__startswith="audio/").exists():
        return None
    if profile is not None:
        from plugins_app.agent.engines.registry import profile_hears_audio
        try:
            if profile_hears_audio(profile):
                return None
        except LookupError:
            return None  # an engine that is not installed fails the turn as it always does
    return UNHEARD_ANSWER.format(model=getattr(profile, "name", None) or "of this conversation")


# --- dictation, read aloud and live calls: not built in this build ------------------------------

DICTATION_UNAVAILABLE = ("Dictation is unavailable here: no transcription engine is installed "
                         "(GET /v1/ugent/status: media.voice.input.dictation is false).")
SPEECH_UNAVAILABLE = ("Read aloud is unavailable here: no speech engine is installed "
                      "(GET /v1/ugent/status: media.voice.output.reason is no_engine).")
LIVE_UNAVAILABLE = ("Live calls are unavailable here: no voice model is installed "
                    "(GET /v1/ugent/status: media.voice.live.reason is no_engine).")
NO_FINISHED_TURN = "No such finished turn in this conversation."


def dictation() -> dict:
    """POST /v1/ugent/transcribe: nothing here can transcribe; a 503 that says so, keeping nothing."""
    raise ApplicationError(DICTATION_UNAVAILABLE, status=503, code="voice_unavailable")


def speech(*, viewer: access.Viewer, conversation_id: str, turn_id: str, segment: int) -> dict:
    """POST /v1/ugent/speech: another person's turn, an unfinished one and an unknown one are a 404 (the
    spec's), then a 503: nothing here can speak."""
    turn = Turn.objects.select_related("conversation").filter(
        turn_id=turn_id, conversation__external_id=conversation_id).first()
    if turn is None or not access.turn_is_theirs(viewer, turn) or turn.state != TurnState.COMPLETED:
        raise ApplicationError(NO_FINISHED_TURN, status=404, code="turn_not_found")
    raise ApplicationError(SPEECH_UNAVAILABLE, status=503, code="voice_unavailable")


def live_call() -> dict:
    """GET /v1/ugent/live as a plain request: this build holds no calls; it is told why (a WebSocket is
    closed with the spec's 4422: channels_app.api_voice.LiveCallSocket)."""
    raise ApplicationError(LIVE_UNAVAILABLE, status=503, code="voice_unavailable")
