"""Agent plugins: ovos-plugin-manager engines, the built-in engines, agent profiles."""
