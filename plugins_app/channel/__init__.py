"""Channel plugins: worker processes, the bridge, the supervisor, the SDK, the outbound queue."""
