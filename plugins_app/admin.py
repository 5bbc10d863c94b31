"""The plugins room's admin, registered by its two halves."""
from plugins_app.agent import admin as _agent_admin  # noqa: F401
from plugins_app.agent.memory import admin as _memory_admin  # noqa: F401
from plugins_app.channel import admin as _channel_admin  # noqa: F401
