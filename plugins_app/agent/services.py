"""Agent profiles' actions: what an operator asks of a profile from the admin."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ugent_common.secrets import secrets_opened

PING = "Reply with the single word: pong"


@dataclass
class ConnectionResult:
    ok: bool
    message: str


def profile_connection_test(*, profile) -> ConnectionResult:
    """One tiny call to the profile's engine (a one-token answer), on a fresh engine; secrets never in the text."""
    from ovos_plugin_manager.templates.agents import AgentMessage, MessageRole

    from plugins_app.agent.engines.registry import engine_class
    config = secrets_opened(dict(profile.config or {}))
    secrets = [v for v in _plain_values(config, profile.config or {}) if v]
    config.update({"max_tokens": 1, "timeout": min(float(config.get("timeout") or 15), 15.0)})
    t0 = time.monotonic()
    engine = None
    try:
        engine = engine_class(profile.provider)(config)
        reply = engine.continue_chat([AgentMessage(role=MessageRole.USER, content=PING)])
        ms = (time.monotonic() - t0) * 1000
        text = (getattr(reply, "content", "") or "").strip()[:80]
        return ConnectionResult(True, _redacted(f"{profile.qualified_name} answered in {ms:.0f} ms: “{text}”.",
                                                secrets))
    except Exception as exc:
        return ConnectionResult(False, _redacted(f"{profile.qualified_name} failed: {exc}", secrets))
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()


def _plain_values(opened: dict, sealed: dict) -> list[str]:
    """The opened values of the sealed secrets (to keep them out of any message)."""
    out = []
    for k, v in sealed.items():
        if isinstance(v, dict) and "$ugent_secret" in v:
            out.append(str(opened.get(k, "")))
        elif isinstance(v, dict) and isinstance(opened.get(k), dict):
            out.extend(_plain_values(opened[k], v))
    return out


def _redacted(text: str, secrets: list[str]) -> str:
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "[secret]")
    return text
