"""Agent engines: the project's own OPM plugins and the streaming contract the turn runner reads."""
