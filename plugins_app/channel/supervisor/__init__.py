"""Channel plugin supervision: worker processes, the restart policy and the supervisor loop.

Imports nothing from Django; ``runsupervisor`` wires it to the Plugin rows.
"""
from .core import (
    ENV_BRIDGE_SOCKET, ENV_PLUGIN_ID, ENV_PLUGIN_TOKEN_FD, DesiredWorker, Supervisor,
    SupervisorAlreadyRunning, WorkerStatus,
)
from .policy import (
    BACKOFF, COOLDOWN, DISABLED, RUNNING, STOPPED, STOPPING, Action, RestartPolicy,
    SupervisionLimits, heartbeat_overdue,
)
from .process import ReapedWorker, WorkerHandle, WorkerSpec, reap_stale

__all__ = [
    "ENV_BRIDGE_SOCKET", "ENV_PLUGIN_ID", "ENV_PLUGIN_TOKEN_FD", "DesiredWorker", "Supervisor",
    "SupervisorAlreadyRunning", "WorkerStatus", "BACKOFF", "COOLDOWN", "DISABLED", "RUNNING",
    "STOPPED", "STOPPING", "Action", "RestartPolicy", "SupervisionLimits", "heartbeat_overdue",
    "ReapedWorker", "WorkerHandle", "WorkerSpec", "reap_stale",
]
