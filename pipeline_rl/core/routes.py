"""The wire form of routing replay's routes: for each token, the experts each MoE layer's router
sent it to, as uint8 (fewer than 255 experts) in one row of (MoE layers x top_k) bytes, and
NO_ROUTE where the engine recorded none (prompt and environment tokens, a completion's last
token: the trainer's own router decides there). A record carries a sequence's rows as base64.
The engine writes them (engine/routes.py), the preprocessor lays them out with the tokens, the
trainer replays them (trainer/routing_replay.py)."""

from __future__ import annotations

import base64
import math

import numpy as np

NO_ROUTE = 255
"""Expert id of a route the engine did not record."""


def encode_routes(routes: np.ndarray) -> str:
    """Base64 of a (tokens, ...) uint8 array."""
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.uint8).tobytes()).decode("ascii")


def encoded_bytes_per_token(width: int) -> int:
    """Bytes a record spends on one token's routes of `width` bytes (base64: 4 per 3)."""
    return math.ceil(width * 4 / 3)


def decode_routes(text: str, tokens: int, where: str) -> np.ndarray:
    """The (tokens, bytes per token) uint8 array of `encode_routes`; raises ValueError naming
    `where` when the bytes do not split into `tokens` equal rows."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: routes are not base64 ({e})") from None
    if tokens <= 0 or not raw or len(raw) % tokens:
        raise ValueError(f"{where}: routes of {len(raw)} bytes do not split into {tokens} tokens")
    return np.frombuffer(raw, dtype=np.uint8).reshape(tokens, len(raw) // tokens)


def no_routes(tokens: int, width: int) -> np.ndarray:
    """`tokens` rows of `width` bytes that leave every token to the trainer's router."""
    return np.full((tokens, width), NO_ROUTE, dtype=np.uint8)
