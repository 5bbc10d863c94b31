"""The plugins room's models, defined by its two halves (Django looks for them here)."""
from plugins_app.agent.models import AgentProfile  # noqa: F401
from plugins_app.channel.models import *  # noqa: F401,F403
from plugins_app.channel.models import PLUGIN_ID_RE  # noqa: F401
from plugins_app.agent.memory.models import MemoryFact, MemorySettings, MemorySighting  # noqa: F401
