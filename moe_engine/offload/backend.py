"""The device behind one interface: placement, asynchronous host->device copies, compute ordering.

The pager, the pipeline and the scheduler are the same code on every backend; only this module
knows what the device is. `CpuBackend` treats the CPU as the device (resident weights are
zero-copy views, copies are memcpys done by a worker thread) so CPU tests exercise the whole
offloading path. `CudaBackend` runs copies on a dedicated stream with events and pinned staging
buffers. No other module touches `torch.cuda`.

Ordering between the two streams (docs/offload.md, "Ordering"): device work is `launch`ed onto
the compute stream; a copy that overwrites memory the compute stream reads carries
`after=record_compute_event()` taken after the last reader was launched, and compute that reads
a copy's bytes is ordered after it by `compute_after(handle)`. The host reads a result of device
work only after `host_sync()`. `async_cpu.AsyncCpuBackend` runs the compute stream on its own
thread so that a missing wait shows up on a CPU.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import torch

from moe_engine.offload.trace import Trace

# Lanes of the trace recorder (also used by the pipeline and the figure).
COPY_LANE = "copy"


class CopyCancelled(RuntimeError):
    """Waiting on a copy that was cancelled before it started."""


class CopyHandle:
    """Completion handle of one asynchronous copy (one packet).

    `wait()` blocks the calling thread until the bytes are on the device; `done()` polls.
    A copy that has not started yet can be cancelled; its bytes never move.
    """

    def __init__(self, nbytes: int, label: str = ""):
        self.nbytes = nbytes
        self.label = label
        self._event = threading.Event()
        self._cancelled = False
        self._started = False
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def wait(self) -> None:
        """Block until the copy has landed (or re-raise the copy's error)."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise CopyCancelled(f"copy {self.label!r} was cancelled")

    def settle(self) -> None:
        """Block until the copy finished, failed or was cancelled, without raising."""
        self._event.wait()

    def cancel(self) -> bool:
        """Cancel the copy if the worker has not started it; True when cancelled."""
        with _CANCEL_LOCK:
            if self._started or self._event.is_set():
                return False
            self._cancelled = True
        self._event.set()
        return True

    def _claim(self) -> bool:
        # The worker claims a request before copying, so cancel and copy never both happen.
        with _CANCEL_LOCK:
            if self._cancelled:
                return False
            self._started = True
            return True


_CANCEL_LOCK = threading.Lock()


class ComputeEvent(ABC):
    """A point in the compute stream: it is reached once all device work launched before it was
    recorded has run."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the compute stream has passed this point."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the compute stream has passed this point."""


class CompletedEvent(ComputeEvent):
    """The event of a backend whose compute runs on the calling thread: the work launched so far
    has already run when the event is recorded."""

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CopyWorker:
    """One thread that performs queued copies one at a time, urgent ones first.

    Weight pages arrive as bounded packets (MoE-Lens 6.5); because only one packet is in the
    link at a time, an urgent copy (activations) waits for at most one packet, never for a
    whole layer of weights.
    """

    def __init__(self, transfer: Callable[[torch.Tensor, Any, CopyHandle,
                                           Optional[ComputeEvent]], None],
                 trace: Optional[Trace], name: str, lane: str = COPY_LANE):
        self._transfer = transfer
        self._trace = trace
        self._lane = lane
        self._queue: list[tuple[int, tuple, int, CopyHandle, torch.Tensor, Any,
                                Optional[ComputeEvent]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self.bytes_moved = 0
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: Any, label: str, urgent: bool,
               after: Optional[ComputeEvent] = None, rank: tuple = ()) -> CopyHandle:
        """Queue a copy of `src` (anything with `nbytes` that the transfer function moves) into
        `dst`, not to start before the compute stream passed `after`. Urgent copies go first,
        then lower `rank` (the order the reader will need them in; all () by default), then
        submission order."""
        handle = CopyHandle(src.nbytes, label)
        with self._cv:
            if self._closed:
                raise RuntimeError("copy worker is closed")
            heapq.heappush(self._queue,
                           (0 if urgent else 1, rank, next(self._seq), handle, dst, src,
                            after))
            self._cv.notify()
        return handle

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for _, _, _, handle, _, _, _ in self._queue:
                handle.cancel()
            self._queue.clear()
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                _, _, _, handle, dst, src, after = heapq.heappop(self._queue)
            if not handle._claim():
                continue
            t0 = time.perf_counter()
            try:
                self._transfer(dst, src, handle, after)
                self.bytes_moved += handle.nbytes
            except BaseException as exc:  # surfaced to whoever waits on the handle
                handle._error = exc
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            if self._trace is not None:
                self._trace.add(self._lane, handle.label, t0, t1)
            handle._event.set()


class Backend(ABC):
    """What the pager and the pipeline need from a device."""

    name: str
    device: torch.device
    @abstractmethod
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor kept for the whole run (resident weights)."""

    @abstractmethod
    def host_store(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory the link can read directly (pinned on CUDA); may return `t` itself."""

    @abstractmethod
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device buffer (the page ring)."""

    # Whether the "device" is the host CPU itself (zero-copy placement, one latency curve for
    # both sides in placement.py, the CPU attention kernels usable on device activations, disk
    # reads landing where compute reads them).
    device_is_host: bool = False

    @abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                   urgent: bool = False, after: Optional[ComputeEvent] = None) -> CopyHandle:
        """Queue a host->device copy of `src` into the device tensor `dst`. With `after`, no
        byte of `dst` is written before the compute stream has passed that event: `dst` may
        still be read by device work launched before it (a page ring slot being refilled).
        The host does not wait for it."""

    @abstractmethod
    def compute_after(self, handle: CopyHandle) -> None:
        """Order the compute stream after a copy; the host waits only as far as needed."""

    @abstractmethod
    def record_compute_event(self) -> ComputeEvent:
        """An event the compute stream reaches once the device work launched so far has run."""

    def launch(self, fn: Callable[..., object], *args) -> None:
        """Run device work `fn(*args)` on the compute stream, after the work launched before.

        Inline here: the CPU computes on the calling thread, and CUDA kernels issued by the
        calling thread are queued on its current stream, the compute stream, anyway. The
        return value is dropped on purpose: results come back only through the tensors and
        objects `fn` writes, and the host reads those after `host_sync()` (on a backend whose
        compute stream is another thread, they do not exist before)."""
        fn(*args)

    def host_sync(self) -> None:
        """Block the host until the compute stream has run all device work launched so far;
        called before the host reads a result of device work (a no-op where compute is
        synchronous). Copies still in the link are not waited for."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Activation device->host (q/k/v before CPU attention)."""
        return t

    def activation_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Activation host->device (attention output, CPU expert output)."""
        return t

    def synchronize(self) -> None:
        """Wait for all device work issued so far (timing boundaries)."""

    @property
    def link_bytes_moved(self) -> int:
        return self._worker.bytes_moved

    @property
    def link_busy_s(self) -> float:
        return self._worker.busy_s

    def close(self) -> None:
        self._worker.close()


class HostMemoryBackend(Backend):
    """A device whose memory is host memory: resident weights are the host tensors themselves
    and a page copy is a memcpy by the copy worker (CpuBackend, and the asynchronous CPU test
    backend)."""

    device_is_host = True

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def host_store(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                   urgent: bool = False, after: Optional[ComputeEvent] = None) -> CopyHandle:
        return self._worker.submit(dst, src, label, urgent, after)


class CpuBackend(HostMemoryBackend):
    """The CPU is the device: resident weights are the host tensors themselves, streamed pages
    are memcpys into the page ring done by a copy worker thread.

    `emulated_link_gbps` simulates a slower host->device link (GB/s, 1e9 bytes): after each
    packet's memcpy the worker sleeps until bytes/bandwidth has elapsed. Sleeping releases the
    GIL, so this is a faithful model of a DMA engine working while compute runs. It exists to
    make overlap observable on a CPU-only machine and is reported as emulated wherever used.
    """

    name = "cpu"

    def __init__(self, emulated_link_gbps: Optional[float] = None,
                 trace: Optional[Trace] = None):
        if emulated_link_gbps is not None and emulated_link_gbps <= 0:
            raise ValueError(f"emulated_link_gbps must be > 0, got {emulated_link_gbps}")
        self.device = torch.device("cpu")
        self.emulated_link_gbps = emulated_link_gbps
        self._link_due = 0.0
        # Compute runs on the calling thread, so every recorded point has been passed already.
        self._completed = CompletedEvent()
        self._worker = CopyWorker(self._transfer, trace, "cpu-copy-worker")

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor, handle: CopyHandle,
                  after: Optional[ComputeEvent]) -> None:
        if after is not None:  # recorded on the calling thread's compute: already passed
            after.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if self.emulated_link_gbps is None:
            return
        # A back-to-back packet starts when the previous one was due, not when its sleep
        # happened to return, so sleep overshoot does not add up and the link keeps its rate.
        start = self._link_due if t0 - self._link_due < 1e-3 else t0
        self._link_due = start + src.nbytes / (self.emulated_link_gbps * 1e9)
        left = self._link_due - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def compute_after(self, handle: CopyHandle) -> None:
        # Compute runs on the calling thread, so it must see the bytes before it goes on.
        handle.wait()

    def record_compute_event(self) -> ComputeEvent:
        return self._completed


class CudaBackend(Backend):
    """Copies on a dedicated CUDA stream, one bounded packet in flight at a time.

    Host weights live in pinned memory (`host_store`), so a packet goes straight to the device
    with a non-blocking copy; a pageable source is first staged through a pinned buffer owned
    by the copy worker. The worker waits on each packet's event before it issues the next, so
    at most one packet occupies the link and a completed handle means the bytes have landed.

    Run on an NVIDIA H100 (2026-11-24): the `gpu` tests and the offload and disk-tier
    benchmarks (docs/offload.md, "On a GPU").
    """

    name = "cuda"

    def __init__(self, device: int | str = 0, trace: Optional[Trace] = None,
                 staging_bytes: int = 64 << 20):
        if not torch.cuda.is_available():
            raise RuntimeError("engine.backend=cuda but CUDA is not available")
        self.device = (torch.device("cuda", device) if isinstance(device, int)
                       else torch.device(device))
        self.compute_stream = torch.cuda.current_stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.activation_stream = torch.cuda.Stream(self.device, priority=-1)
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8).pin_memory()
        self._worker = CopyWorker(self._transfer, trace, "cuda-copy-worker")

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor, handle: CopyHandle,
                  after: Optional[ComputeEvent]) -> None:
        if not src.is_pinned():
            if src.nbytes > self._staging.numel():
                raise ValueError(f"packet of {src.nbytes} bytes exceeds the pinned staging buffer")
            staged = self._staging[:src.nbytes].view(src.dtype).view(src.shape)
            staged.copy_(src)
            src = staged
        event = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):
            if after is not None:
                # The device-side wait that makes refilling a ring slot safe: the copy engine
                # does not start before the compute stream passed the slot's last reader. The
                # host (this worker included) is not blocked by it, only the copy stream.
                self.copy_stream.wait_event(_cuda_event(after))
            dst.copy_(src, non_blocking=True)
            event.record(self.copy_stream)
        # Not an ordering device: one packet in the link at a time (bounded head-of-line
        # blocking for activation copies), the staging buffer is free again afterwards, and a
        # completed handle means the bytes have landed (what `compute_after` and the pager's
        # `bytes_to_move` rely on). With `after`, this also waits for the compute stream to
        # reach that point; packets behind this one are for the same or a later slot fill, so
        # they could not have started earlier anyway.
        event.synchronize()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def host_store(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                   urgent: bool = False, after: Optional[ComputeEvent] = None) -> CopyHandle:
        return self._worker.submit(dst, src, label, urgent, after)

    def compute_after(self, handle: CopyHandle) -> None:
        # The handle completes only after the packet's event, so kernels queued from now on
        # read landed bytes. (The host waits here because the packet's CUDA event exists only
        # once the worker issued it; a packet still queued has nothing to wait_event on.)
        handle.wait()

    def record_compute_event(self) -> ComputeEvent:
        event = torch.cuda.Event()
        event.record(self.compute_stream)
        return _CudaComputeEvent(event)

    def host_sync(self) -> None:
        # The compute stream only: copies in the link keep running (torch.cuda.synchronize, as
        # in `synchronize`, would wait for the prefetch of the next layer too).
        self.compute_stream.synchronize()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def activation_to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        with torch.cuda.stream(self.activation_stream):
            out = t.pin_memory().to(self.device, non_blocking=True)
        self.compute_stream.wait_stream(self.activation_stream)
        return out

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _CudaComputeEvent(ComputeEvent):
    """A torch.cuda.Event recorded on the compute stream."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def _cuda_event(event: ComputeEvent) -> "torch.cuda.Event":
    if not isinstance(event, _CudaComputeEvent):
        raise TypeError(f"a CUDA copy can only wait on a CUDA compute event, got {event!r}")
    return event.event


def make_backend(kind: str, emulated_link_gbps: Optional[float] = None,
                 trace: Optional[Trace] = None) -> Backend:
    """The backend named by engine.backend ('cpu' | 'cuda')."""
    kind = getattr(kind, "value", kind)
    if kind == "cpu":
        return CpuBackend(emulated_link_gbps, trace)
    if kind == "cuda":
        if emulated_link_gbps is not None:
            raise ValueError("an emulated link is a CPU-backend simulator; CUDA has a real link")
        return CudaBackend(trace=trace)
    raise ValueError(f"unknown backend {kind!r} (cpu | cuda)")


def cuda_available() -> bool:
    """Whether a CUDA device exists (for tests and the CLI; keeps torch.cuda in this module)."""
    return torch.cuda.is_available()
