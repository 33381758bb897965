"""A sequence in flight: its tokens, KV block table, and where it is in its life."""
from __future__ import annotations

from enum import Enum
from itertools import count
from typing import Optional

from moe_engine.engine.request import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens of one request and the KV blocks that hold them."""

    _ids = count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 seed: int, max_total_tokens: int):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.seed = seed  # fixed at admission so recompute after preemption samples the same
        self.max_total_tokens = max_total_tokens
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.window_table: list[int] = []  # sliding-window layers' blocks (WindowPool)
        self.num_cached_tokens = 0  # tokens whose K/V are in the cache
        self.finish_reason: Optional[str] = None
        self.stop_text: Optional[str] = None  # completion text cut at a stop string
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_prefill(self) -> bool:
        """True when the next step must compute K/V of all tokens (new or preempted)."""
        return self.num_cached_tokens == 0

    @property
    def num_step_tokens(self) -> int:
        """Tokens this sequence feeds into the next step."""
        return self.num_tokens if self.is_prefill else 1

    def max_remaining_tokens(self) -> int:
        return min(self.sampling.max_new_tokens - self.num_completion_tokens,
                   self.max_total_tokens - self.num_tokens)
