"""An MCP server on stdio that stops reading: it answers the handshake and the tool list, then closes its
input and goes on running, so the client's next write breaks while the end of its output never comes
(tests/plugins_app/test_mcp_toolbox.py). It speaks MCP's JSON-RPC lines by hand to stop at that point.

    python tests/data/mcp_server_deaf.py
"""
import json
import os
import sys
import time


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read():
    return json.loads(sys.stdin.readline())


hello = read()
send({"jsonrpc": "2.0", "id": hello["id"], "result": {
    "protocolVersion": hello["params"]["protocolVersion"], "capabilities": {"tools": {}},
    "serverInfo": {"name": "ugent-test-deaf", "version": "1"}}})
read()  # notifications/initialized
listing = read()
send({"jsonrpc": "2.0", "id": listing["id"], "result": {"tools": [{
    "name": "add", "description": "Add two integers.",
    "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]}})
os.close(0)  # deaf from here on: the client's writes break
time.sleep(60)
