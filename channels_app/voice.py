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

from channels_app.models import File

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
