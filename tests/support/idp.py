"""An identity provider on loopback: RSA and EC keys generated here, a JWKS served over HTTP, tokens.

The JWKS is the document RFC 7517 describes (`{"keys": [...]}`, each key with `kid`, `kty`, `use`),
served with a `Cache-Control` the test sets. `hits` counts the fetches; `hold` makes the next fetches
wait until `release()` (a provider that hangs); `down()` answers 503.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "example-crm"  # the issuer the shared cast's application lists
AUDIENCE = "ugent-test"
PREFIX = "crm:"


class SigningKey:
    def __init__(self, kind: str, kid: str | None = None):
        self.kind = kind
        self.kid = kid or f"{kind}-{uuid.uuid4().hex[:8]}"
        if kind == "rsa":
            self.private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.alg = "RS256"
            self.jwk = RSAAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        else:
            self.private = ec.generate_private_key(ec.SECP256R1())
            self.alg = "ES256"
            self.jwk = ECAlgorithm.to_jwk(self.private.public_key(), as_dict=True)
        self.jwk.update({"kid": self.kid, "use": "sig", "alg": self.alg})

    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo)


def claims(sub="carol", *, iss=ISSUER, aud=AUDIENCE, exp_in=300, nbf_in=None, **extra) -> dict:
    now = int(time.time())
    out = {"iss": iss, "aud": aud, "sub": sub, "iat": now}
    if exp_in is not None:
        out["exp"] = now + exp_in
    if nbf_in is not None:
        out["nbf"] = now + nbf_in
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


def sign(key: SigningKey, payload: dict, *, kid: str | None = None) -> str:
    return jwt.encode(payload, key.private, algorithm=key.alg, headers={"kid": kid or key.kid})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(payload: dict) -> str:
    """`alg: none`, built by hand (a library refuses to make one)."""
    head = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{head}.{_b64(json.dumps(payload).encode())}."


def hs256_with_public_key(key: SigningKey, payload: dict) -> str:
    """HS256 keyed with the RSA public key's PEM: the algorithm-confusion attack, built by hand."""
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": key.kid}).encode())
    body = _b64(json.dumps(payload).encode())
    mac = hmac.new(key.public_pem(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


class JwksServer:
    def __init__(self, *keys: SigningKey, cache_control: str = "public, max-age=3600"):
        self.keys = list(keys)
        self.cache_control = cache_control
        self.hits = 0
        self.status = 200
        self._gate = threading.Event()
        self._gate.set()
        self.waiting = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.hits += 1
                if not server._gate.is_set():
                    server.waiting.set()
                    server._gate.wait(30)
                body = json.dumps({"keys": [k.jwk for k in server.keys]}).encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Cache-Control", server.cache_control)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/.well-known/jwks.json"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def hold(self):
        self._gate.clear()

    def release(self):
        self._gate.set()

    def close(self):
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()
