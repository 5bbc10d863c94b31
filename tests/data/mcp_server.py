"""A real MCP server on stdio, built with the `mcp` package's own FastMCP, for the tool loop's tests.

    python tests/data/mcp_server.py      (speaks MCP on stdin/stdout until stdin closes)
"""
from mcp.server.fastmcp import FastMCP

app = FastMCP("ugent-test")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


if __name__ == "__main__":
    app.run("stdio")
