"""Public request/result types: what a caller gives the engine and what comes back."""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature == 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> Optional[str]:
        """The reason these parameters are invalid, or None when they are fine."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            return f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
        if not _finite(self.temperature) or self.temperature < 0:
            return f"temperature must be a finite number >= 0, got {self.temperature!r}"
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            return f"seed must be a non-negative integer or None, got {self.seed!r}"
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            return f"stop must be a sequence of non-empty strings, got {self.stop!r}"
        return None


def stable_seed(base_seed: int, request_id: str) -> int:
    """Sampling seed of a request that names none: a pure function of a base seed and the
    request id, so a request re-run after a kill (in another process, another batch) draws the
    same numbers. The corpus reader fills rows' seeds with it; the engine uses base 0."""
    return (base_seed * 1_000_003 + zlib.crc32(request_id.encode("utf-8"))) % (2**31 - 1)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Request:
    """One generation request: exactly one of prompt, messages (chat) or prompt_token_ids."""

    request_id: str
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    prompt_token_ids: Optional[list[int]] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class RequestResult:
    """The outcome of one request. status is ok, rejected (bad input) or error (engine failure)."""

    request_id: str
    status: str
    finish_reason: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def rejected(cls, request_id: str, reason: str,
                 prompt_token_ids: Optional[list[int]] = None) -> "RequestResult":
        ids = list(prompt_token_ids or [])
        return cls(request_id=request_id, status="rejected", prompt_token_ids=ids,
                   prompt_tokens=len(ids), error=reason)
