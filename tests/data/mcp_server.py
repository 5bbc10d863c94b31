"""A real MCP server on stdio, built with the `mcp` package's own FastMCP, for the tool loop's tests.

    python tests/data/mcp_server.py      (speaks MCP on stdin/stdout until stdin closes)
"""
from mcp.server.fastmcp import FastMCP, Image

app = FastMCP("ugent-test")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@app.tool()
async def wait(seconds: float, started: str = "") -> str:
    """Answer after this many seconds (a slow tool; the server answers other calls meanwhile). With
    `started`, a file of that name is written when the call begins."""
    import anyio
    if started:
        open(started, "w").close()
    await anyio.sleep(seconds)
    return "waited"


@app.tool()
def chart() -> Image:
    """A one-pixel PNG chart, returned as MCP image content (a file the turn returns)."""
    import zlib

    def chunk(kind, data):
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    ihdr = (1).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00"))
           + chunk(b"IEND", b""))
    return Image(data=png, format="png")


if __name__ == "__main__":
    app.run("stdio")
