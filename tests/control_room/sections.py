"""A status section for the board's tests: the rules section plus a field it may gain later."""


def rules_plus() -> dict:
    from rules_app.runtime import status_section
    return {**status_section(), "enforcer_pid": 4242, "heartbeat_at": "2026-01-01T00:00:00+00:00"}
