"""The "WXBizMsgCrypt" callback crypto of WeCom and Weixin (the official account's safe mode), and the
flat XML their callbacks carry, written out (no wechatpy). DingTalk's callback encryption is the same
construction with JSON around it.

* ``msg_signature`` = hex(SHA1(the four strings token, timestamp, nonce, encrypt sorted and joined));
* the AES key = base64decode(EncodingAESKey + "=") (43 characters, 32 bytes); AES-256-CBC with the
  key's first 16 bytes as the IV and no cipher padding of its own;
* the plaintext = 16 random bytes + the message's length (4 bytes, big-endian) + the message (UTF-8)
  + the receive id (WeCom internal app: the corp id; Weixin: the AppID; DingTalk: the owner key), padded PKCS#7 to a multiple of 32 bytes
  (pad values 1 to 32); the ciphertext travels as standard base64.

Checked against every ``wecom-*`` vector of tests/data/webhook-signature-vectors.json (and the two
``weixin-mp-aes-encrypt-fixed-random-*``, the same scheme) in tests/plugins_app/test_channel_wecom_parts.py.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from xml.parsers import expat

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK = 32


class CryptoError(ValueError):
    """A callback that does not verify or decrypt: a bad signature, ciphertext or receive id."""


def signature(token: str, timestamp: str, nonce: str, encrypt: str) -> str:
    """``msg_signature``: hex SHA1 of the four strings sorted and joined, no separator."""
    return hashlib.sha1("".join(sorted([token, timestamp, nonce, encrypt])).encode()).hexdigest()


def aes_key(encoding_aes_key: str) -> bytes:
    if len(encoding_aes_key) != 43:
        raise CryptoError("the EncodingAESKey must be 43 characters")
    try:
        key = base64.b64decode(encoding_aes_key + "=", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CryptoError("the EncodingAESKey is not base64") from exc
    if len(key) != 32:
        raise CryptoError("the EncodingAESKey does not decode to 32 bytes")
    return key


def pad(data: bytes) -> bytes:
    n = BLOCK - len(data) % BLOCK
    return data + bytes([n]) * n


def unpad(data: bytes) -> bytes:
    n = data[-1] if data else 0
    if not 1 <= n <= BLOCK or data[-n:] != bytes([n]) * n:
        raise CryptoError("bad padding")
    return data[:-n]


class MsgCrypt:
    """One app's callback crypto: its Token, EncodingAESKey and receive id."""

    def __init__(self, token: str, encoding_aes_key: str, receive_id: str):
        self.token = token
        self.key = aes_key(encoding_aes_key)
        self.receive_id = receive_id

    def _cipher(self) -> Cipher:
        return Cipher(algorithms.AES(self.key), modes.CBC(self.key[:16]))

    def signature(self, timestamp: str, nonce: str, encrypt: str) -> str:
        return signature(self.token, timestamp, nonce, encrypt)

    def signature_valid(self, msg_signature: str | None, timestamp: str, nonce: str, encrypt: str) -> bool:
        """Whether ``msg_signature`` signs these (compared in constant time)."""
        if not msg_signature or not self.token:
            return False
        return hmac.compare_digest(self.signature(timestamp, nonce, encrypt).encode(),
                                   msg_signature.lower().encode())

    def encrypt(self, message: str, *, random16: bytes | None = None) -> str:
        """``message`` as the base64 ciphertext WeCom sends (``random16``: fixed only in tests)."""
        random16 = os.urandom(16) if random16 is None else random16
        if len(random16) != 16:
            raise ValueError("random16 must be 16 bytes")
        body = message.encode()
        plain = pad(random16 + struct.pack(">I", len(body)) + body + self.receive_id.encode())
        enc = self._cipher().encryptor()
        return base64.b64encode(enc.update(plain) + enc.finalize()).decode()

    def decrypt(self, encrypt: str) -> str:
        """The message inside ``encrypt``; raises CryptoError unless it is well formed and for this receive id."""
        try:
            data = base64.b64decode(encrypt, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise CryptoError("the ciphertext is not base64") from exc
        if not data or len(data) % 16:
            raise CryptoError("the ciphertext is not whole AES blocks")
        dec = self._cipher().decryptor()
        plain = unpad(dec.update(data) + dec.finalize())
        if len(plain) < 20:
            raise CryptoError("the plaintext is too short")
        (length,) = struct.unpack(">I", plain[16:20])
        if 20 + length > len(plain):
            raise CryptoError("the plaintext's length field is wrong")
        body, receive_id = plain[20:20 + length], plain[20 + length:]
        if not hmac.compare_digest(receive_id, self.receive_id.encode()):
            raise CryptoError("the receive id is not this app's")
        try:
            return body.decode()
        except UnicodeDecodeError as exc:
            raise CryptoError("the message is not UTF-8") from exc

    def open(self, msg_signature: str | None, timestamp: str, nonce: str, encrypt: str) -> str:
        """Verify, then decrypt: an ``echostr`` (URL verification) or a callback's ``Encrypt``."""
        if not self.signature_valid(msg_signature, timestamp, nonce, encrypt):
            raise CryptoError("msg_signature does not verify")
        return self.decrypt(encrypt)

    def seal(self, message: str, timestamp: str, nonce: str, *, random16: bytes | None = None) -> tuple[str, str]:
        """``message`` encrypted and signed as WeCom sends it: (encrypt, msg_signature)."""
        encrypt = self.encrypt(message, random16=random16)
        return encrypt, self.signature(timestamp, nonce, encrypt)

    def reply_xml(self, message: str, timestamp: str, nonce: str, *, random16: bytes | None = None) -> str:
        """A passive reply's envelope (the format WeCom's samples answer a callback with)."""
        encrypt, sig = self.seal(message, timestamp, nonce, random16=random16)
        return (f"<xml>\n<Encrypt><![CDATA[{encrypt}]]></Encrypt>\n<MsgSignature><![CDATA[{sig}]]></MsgSignature>\n"
                f"<TimeStamp>{timestamp}</TimeStamp>\n<Nonce><![CDATA[{nonce}]]></Nonce>\n</xml>")


#: Fields kept exactly as sent: what a user wrote (leading indentation, trailing newlines of pasted code).
VERBATIM = frozenset({"Content"})


def parse_xml(text: str | bytes) -> dict[str, str]:
    """A flat WeCom XML document (``<xml><Name>value</Name>...</xml>``, a field one level deeper as a dict) as
    a dict; ValueError otherwise. A document type declaration (and so any entity) is refused by the parser
    itself, in any encoding: the outer envelope is parsed before its signature is checked, and a declared
    entity can expand a megabyte into gigabytes. Text that merely mentions ``<!DOCTYPE`` (a user asking
    about HTML, inside CDATA) is text."""
    raw = text.encode() if isinstance(text, str) else text
    parser = expat.ParserCreate()

    def refuse(*_args):
        raise ValueError("a document type declaration is not taken")

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    out: dict = {}
    names: list[str] = []
    texts: list[list[str]] = []

    def start(name, _attrs):
        names.append(name)
        texts.append([])

    def end(name):
        value = "".join(texts.pop())
        names.pop()
        if len(names) == 1:  # a field of the document
            if not isinstance(out.get(name), dict):
                out[name] = value if name in VERBATIM else value.strip()
        elif len(names) == 2:  # a field of a field
            parent = out.get(names[1])
            if not isinstance(parent, dict):
                parent = out[names[1]] = {}
            parent[name] = value.strip()

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = lambda data: texts[-1].append(data) if texts else None
    try:
        parser.Parse(raw, True)
    except expat.ExpatError as exc:
        raise ValueError(f"not XML: {exc}") from None
    return out
