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
# Deaf from here on, before the list is answered: a call the client sends once it has the list always
# meets a closed pipe. (Closed after the answer, a quick client's call could reach the pipe first and
# wait out its timeout unread.)
os.close(0)
send({"jsonrpc": "2.0", "id": listing["id"], "result": {"tools": [{
    "name": "add", "description": "Add two integers.",
    "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]}})
time.sleep(60)
