"""Routing profile: how often each expert of each layer was chosen on a calibration run.

The pager keeps the most-used experts resident (Twiddler 3.4) and streams the others hot-first
(Klotski 5); both read the ranking from here. The profile is saved as `routing_profile.json`
next to the model, or under a cache dir keyed by the model path when the model dir is read-only.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from moe_engine.io import default_cache_dir, write_text_atomic

PROFILE_NAME = "routing_profile.json"


@dataclass(frozen=True)
class RoutingProfile:
    """counts[layer][expert]: tokens routed to that expert over the calibration run."""

    counts: tuple[tuple[int, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0]) if self.counts else 0

    def ranking(self, layer: int) -> list[int]:
        """Experts of `layer`, most used first (ties: lower index first, so it is stable)."""
        c = self.counts[layer]
        return sorted(range(len(c)), key=lambda e: (-c[e], e))

    def frequency(self, layer: int) -> list[float]:
        """Share of the layer's routed tokens each expert received (uniform when empty)."""
        c = self.counts[layer]
        total = sum(c)
        return [x / total for x in c] if total else [1.0 / len(c)] * len(c)

    def resident_set(self, layer: int, ratio: float) -> frozenset[int]:
        """The round(ratio * E) most-used experts of `layer`."""
        n = round(ratio * len(self.counts[layer]))
        return frozenset(self.ranking(layer)[:n])

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int) -> "RoutingProfile":
        """No information: every expert equally used (ranking falls back to index order)."""
        return cls(tuple((0,) * num_experts for _ in range(num_layers)))

    def to_json(self) -> str:
        return json.dumps({"version": 1, "counts": [list(c) for c in self.counts]})

    @classmethod
    def from_json(cls, text: str) -> "RoutingProfile":
        data = json.loads(text)
        counts = tuple(tuple(int(x) for x in row) for row in data["counts"])
        if not counts or len({len(r) for r in counts}) != 1:
            raise ValueError("routing profile needs the same number of experts in every layer")
        return cls(counts)

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "RoutingProfile":
        return cls.from_json(Path(path).read_text())


class RoutingRecorder:
    """Accumulates router choices (the top-k expert indices) per layer during a run."""

    def __init__(self, num_layers: int, num_experts: int):
        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)

    def record(self, layer: int, experts: torch.Tensor) -> None:
        """Count one step's routing of `layer`: experts is [T, k] of expert indices."""
        self._counts[layer] += torch.bincount(experts.reshape(-1).cpu(),
                                              minlength=self._counts.shape[1])

    def profile(self) -> RoutingProfile:
        return RoutingProfile(tuple(tuple(int(x) for x in row) for row in self._counts.tolist()))


def profile_path(model_dir: str | Path, cache_dir: Optional[str | Path] = None) -> Path:
    """Where the model's profile lives: next to the model when that dir is writable, else
    under the cache dir in a folder named by a hash of the model's absolute path."""
    model_dir = Path(model_dir).resolve()
    beside = model_dir / PROFILE_NAME
    if beside.exists() or os.access(model_dir, os.W_OK):
        return beside
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / key / PROFILE_NAME


def find_profile(model_dir: str | Path,
                 cache_dir: Optional[str | Path] = None) -> Optional[RoutingProfile]:
    """The saved profile of a model, or None when none was recorded yet."""
    for path in (Path(model_dir) / PROFILE_NAME, profile_path(model_dir, cache_dir)):
        if path.exists():
            return RoutingProfile.load(path)
    return None
