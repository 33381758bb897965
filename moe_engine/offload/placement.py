"""Where each non-resident expert runs: on the CPU from host memory, or on the device after its
weights stream in (Twiddler Alg. 1), from measured latency curves.

Twiddler's rule per expert with s > 0 routed tokens: a resident expert runs on the device;
otherwise it runs on the device when cpu_lat(s) > transfer_lat + device_lat(s), else on the CPU.
Here transfer_lat counts only the bytes still to move, so an expert whose pages were already
prefetched costs no transfer.
"""
from __future__ import annotations

import bisect
import json
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Callable, Optional, Sequence

import torch

from moe_engine.model.weights import ExpertWeights


class Place(str, Enum):
    device = "device"
    cpu = "cpu"
    skip = "skip"  # no token routed to the expert this step


@dataclass(frozen=True)
class LatencyCurve:
    """Latency (s) against token count, piecewise linear through measured points and linearly
    extrapolated past the last one (an expert GEMM grows linearly once it is compute-bound)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ValueError("a latency curve needs at least two (tokens, seconds) points")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("latency curve token counts must be strictly increasing")

    def __call__(self, s: int) -> float:
        t, y = self.tokens, self.seconds
        i = min(max(bisect.bisect_left(t, s), 1), len(t) - 1)
        x0, x1, y0, y1 = t[i - 1], t[i], y[i - 1], y[i]
        return max(0.0, y0 + (y1 - y0) * (s - x0) / (x1 - x0))

    @classmethod
    def linear(cls, fixed_s: float, per_token_s: float) -> "LatencyCurve":
        """fixed + per_token * s (for tests and analytic models)."""
        return cls((0, 1024), (fixed_s, fixed_s + 1024 * per_token_s))


@dataclass(frozen=True)
class ExpertLatencyProfile:
    """cpu_lat(s), device_lat(s) for one expert and the host->device link bandwidth."""

    cpu: LatencyCurve
    device: LatencyCurve
    link_bytes_per_s: float
    expert_bytes: int

    def transfer_lat(self, nbytes: int | None = None) -> float:
        return (self.expert_bytes if nbytes is None else nbytes) / self.link_bytes_per_s

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ExpertLatencyProfile":
        d = json.loads(text)
        return cls(cpu=LatencyCurve(tuple(d["cpu"]["tokens"]), tuple(d["cpu"]["seconds"])),
                   device=LatencyCurve(tuple(d["device"]["tokens"]), tuple(d["device"]["seconds"])),
                   link_bytes_per_s=float(d["link_bytes_per_s"]),
                   expert_bytes=int(d["expert_bytes"]))


def place_expert(tokens: int, resident: bool, bytes_to_move: int,
                 profile: ExpertLatencyProfile) -> Place:
    """Twiddler Alg. 1 for one expert; `bytes_to_move` = its pages not yet on the device."""
    if tokens == 0:
        return Place.skip
    if resident:
        return Place.device
    device = profile.transfer_lat(bytes_to_move) + profile.device(tokens)
    return Place.device if profile.cpu(tokens) > device else Place.cpu


def crossover_tokens(profile: ExpertLatencyProfile, bytes_to_move: int | None = None,
                     limit: int = 1 << 16) -> int | None:
    """Smallest token count from which a streamed expert runs on the device (None: never, up
    to `limit`). The pager prefetches an expert when its expected load reaches this."""
    lo, hi = 1, limit
    moved = profile.expert_bytes if bytes_to_move is None else bytes_to_move

    def on_device(s: int) -> bool:
        return place_expert(s, False, moved, profile) is Place.device

    if not on_device(hi):
        return None
    while lo < hi:  # the device side wins for all s past the crossover (CPU cost grows faster)
        mid = (lo + hi) // 2
        if on_device(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _time_call(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_expert_profile(backend, expert: ExpertWeights,
                           token_counts: Sequence[int] = (1, 8, 32, 128, 512),
                           repeats: int = 3) -> ExpertLatencyProfile:
    """Measure one expert's SwiGLU on the host and on the backend's device at several token
    counts, and the link bandwidth with one expert-sized copy through the backend.

    On the CPU backend the device is the host: one curve is measured and used for both, so
    the rule deterministically keeps non-resident experts on the CPU (moving bytes to the same
    silicon never pays), instead of flipping on timing noise between two measurements.
    """
    from moe_engine.model.layers import moe_ffn
    from moe_engine.model.packed import is_packed, packed_inputs

    host = expert.map(lambda t: t.contiguous())  # scales too, for quantized experts
    # Packed experts (the CPU kernels) take fp32 activations whatever their storage.
    act_dtype = torch.float32 if is_packed(host) else host.w13.dtype
    same_silicon = backend.device_is_host
    dev = host if same_silicon else host.map(backend.to_device)
    hidden = packed_inputs(host.w13) if is_packed(host) else host.w13.shape[1]
    cpu_s, dev_s = [], []
    for n in token_counts:
        x = torch.randn(n, hidden, dtype=act_dtype)
        weights = torch.ones(n, 1)
        idx = torch.zeros(n, 1, dtype=torch.int64)
        with torch.inference_mode():
            cpu_s.append(_time_call(lambda: moe_ffn([host], x, weights, idx), lambda: None,
                                    repeats))
            if same_silicon:
                dev_s.append(cpu_s[-1])
                continue
            xd = backend.activation_to_device(x)
            wd, idd = backend.activation_to_device(weights), backend.activation_to_device(idx)
            dev_s.append(_time_call(lambda: moe_ffn([dev], xd, wd, idd), backend.synchronize,
                                    repeats))
    flat = host.w13.reshape(-1)
    dst = backend.empty(flat.numel(), flat.dtype)
    src = backend.host_store(flat)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.copy_async(dst, src, label="profile").wait()
        best = min(best, time.perf_counter() - t0)
    link = flat.nbytes / best
    return ExpertLatencyProfile(LatencyCurve(tuple(token_counts), tuple(cpu_s)),
                                LatencyCurve(tuple(token_counts), tuple(dev_s)),
                                link_bytes_per_s=link,
                                expert_bytes=host.nbytes())


class ExpertPlacer:
    """The policy's FFN placement plus Twiddler's per-expert rule, and what to prefetch.

    ffn_on_device=False puts every expert on the CPU (the policy chose CPU FFN); otherwise
    resident experts run on the device and streamed ones follow `place_expert`. With every
    expert resident there is nothing to decide, so no latency profile is needed (None).
    """

    def __init__(self, profile: Optional[ExpertLatencyProfile], ffn_on_device: bool = True):
        self.profile = profile
        self.ffn_on_device = ffn_on_device
        self.prefetch_from_tokens = (crossover_tokens(profile)
                                     if ffn_on_device and profile is not None else None)

    def decide(self, tokens: int, resident: bool, bytes_to_move: int) -> Place:
        if tokens == 0:
            return Place.skip
        if not self.ffn_on_device:
            return Place.cpu
        if self.profile is None and not resident:
            raise ValueError("a streamed expert needs a latency profile to be placed")
        return place_expert(tokens, resident, bytes_to_move, self.profile)

    def should_prefetch(self, expected_tokens: float) -> bool:
        """Stream an expert ahead when its expected load would put it on the device anyway."""
        threshold = self.prefetch_from_tokens
        return threshold is not None and expected_tokens >= threshold
