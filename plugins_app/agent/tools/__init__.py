"""Agent tools: the built-in ToolBoxes (workspace files) and ToolBox plugins found through
``opm.agents.toolbox``, MCP servers among them (ovos-tool-adapters). No hub imports here: the hub's
own toolboxes (delegation, questions) live in ``channels_app.tools``."""
