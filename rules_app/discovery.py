"""Find the rules file and the routing file for a workspace.

Pure Python, no Django. The workspace, the parsed ugent.toml (a dict), the
home directory and the workspace trust check are all passed in.

Rules: ``[rules] file`` in ugent.toml, used as written (a relative path is
taken from the workspace, ``~`` is not expanded); without it the first of
``<workspace>/rules.toml``, ``<workspace>/.ugent/rules.toml``,
``~/.ugent/rules.toml`` that exists. Routing: the same three locations with
``routing.toml``; an inline ``[routing]`` in ugent.toml is ignored with a
warning. A file inside the workspace is used only once the workspace is
trusted; until then it is skipped with a warning and the search goes on to
the next location.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]
TrustCheck = Callable[[Path], bool]

APPROVE_COMMAND = "python manage.py firewall workspace approve"
UNTRUSTED_WARNING = (
    "{kind} file {path} is inside the workspace, which is not trusted yet; "
    "skipped until the workspace is approved with `{command}`"
)
INLINE_ROUTING_WARNING = (
    "an inline [routing] table in ugent.toml is ignored; routes are read only from a "
    "routing.toml in {locations}"
)
CONFIGURED_MISSING_WARNING = "rules file {path} (from [rules] file in ugent.toml) does not exist"
BAD_FILE_KEY_WARNING = "[rules] file in ugent.toml must be a string; ignored"
BAD_ON_ERROR_WARNING = '[rules] on_error must be "open" or "closed", not {value!r}; using "open"'

ON_ERROR_OPEN = "open"
ON_ERROR_CLOSED = "closed"


@dataclass(frozen=True)
class Discovery:
    """Where a rules or routing file was found, and what was said on the way."""

    path: Optional[Path]
    """The file to load (it exists and may be used), or None."""
    configured: bool = False
    """True when the path came from ``[rules] file``: then a later-created file is not polled for."""
    configured_path: Optional[Path] = None
    """The ``[rules] file`` path as resolved, whether or not it exists."""
    candidates: tuple[Path, ...] = ()
    """The discovery locations searched, in order (empty when configured)."""
    skipped_untrusted: tuple[Path, ...] = ()
    """Files that exist but were skipped because the workspace is not trusted."""
    warnings: tuple[str, ...] = ()

    @property
    def pollable(self) -> bool:
        """True when discovery should be run again while no file is loaded: a file created later in a discovery
        location is picked up, and so is a file skipped only because its workspace is not trusted yet (a
        ``[rules] file`` inside the workspace too), once the workspace is approved."""
        return not self.configured or bool(self.skipped_untrusted)


def candidate_paths(workspace: PathLike, home: PathLike, filename: str) -> tuple[Path, ...]:
    """The discovery locations for ``filename``, in order of preference."""
    ws = Path(workspace)
    return (ws / filename, ws / ".ugent" / filename, Path(home) / ".ugent" / filename)


def is_inside(path: PathLike, directory: PathLike) -> bool:
    """True when ``path`` resolves to somewhere under ``directory``."""
    try:
        return Path(path).resolve().is_relative_to(Path(directory).resolve())
    except OSError:
        return False


def _search(
    workspace: Path,
    home: Path,
    filename: str,
    kind: str,
    is_trusted: TrustCheck,
    warnings: list[str],
) -> Discovery:
    candidates = candidate_paths(workspace, home, filename)
    skipped: list[Path] = []
    found: Optional[Path] = None
    for cand in candidates:
        if not cand.is_file():
            continue
        if is_inside(cand, workspace) and not is_trusted(workspace):
            skipped.append(cand)
            warnings.append(UNTRUSTED_WARNING.format(kind=kind, path=cand, command=APPROVE_COMMAND))
            continue
        found = cand
        break
    return Discovery(
        path=found,
        candidates=candidates,
        skipped_untrusted=tuple(skipped),
        warnings=tuple(warnings),
    )


def _section(config: Optional[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    if not config:
        return {}
    section = config.get(name)
    return section if isinstance(section, Mapping) else {}


def discover_rules_file(
    workspace: PathLike,
    config: Optional[Mapping[str, Any]] = None,
    *,
    home: Optional[PathLike] = None,
    is_trusted: TrustCheck,
) -> Discovery:
    """Find the rules file for ``workspace`` given the parsed ugent.toml ``config``.

    ``home`` defaults to the user's home directory. ``is_trusted(workspace)``
    is asked only when the chosen file lies inside the workspace.
    """
    ws = Path(workspace)
    home_dir = Path(home) if home is not None else Path.home()
    warnings: list[str] = []
    section = _section(config, "rules")
    configured = section.get("file")
    if configured is not None and not isinstance(configured, str):
        warnings.append(BAD_FILE_KEY_WARNING)
        configured = None
    if configured is not None:
        # Used as written: relative to the workspace, and "~" is an ordinary path component.
        path = Path(configured)
        if not path.is_absolute():
            path = ws / path
        if not path.is_file():
            warnings.append(CONFIGURED_MISSING_WARNING.format(path=path))
            return Discovery(None, True, path, warnings=tuple(warnings))
        if is_inside(path, ws) and not is_trusted(ws):
            warnings.append(UNTRUSTED_WARNING.format(kind="rules", path=path, command=APPROVE_COMMAND))
            return Discovery(None, True, path, skipped_untrusted=(path,), warnings=tuple(warnings))
        return Discovery(path, True, path, warnings=tuple(warnings))
    return _search(ws, home_dir, "rules.toml", "rules", is_trusted, warnings)


def discover_routing_file(
    workspace: PathLike,
    config: Optional[Mapping[str, Any]] = None,
    *,
    home: Optional[PathLike] = None,
    is_trusted: TrustCheck,
) -> Discovery:
    """Find routing.toml for ``workspace``; an inline ``[routing]`` in ``config`` is ignored with a warning."""
    ws = Path(workspace)
    home_dir = Path(home) if home is not None else Path.home()
    warnings: list[str] = []
    if config and "routing" in config:
        locations = ", ".join(str(p) for p in candidate_paths(ws, home_dir, "routing.toml"))
        warnings.append(INLINE_ROUTING_WARNING.format(locations=locations))
    return _search(ws, home_dir, "routing.toml", "routing", is_trusted, warnings)


def rules_on_error(config: Optional[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """Return (``"open"`` or ``"closed"``, warning or None) from ``[rules] on_error``."""
    value = _section(config, "rules").get("on_error", ON_ERROR_OPEN)
    if value in (ON_ERROR_OPEN, ON_ERROR_CLOSED):
        return value, None
    return ON_ERROR_OPEN, BAD_ON_ERROR_WARNING.format(value=value)
