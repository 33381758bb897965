"""Where each expert's bytes are on disk, in the layout the engine computes with.

An expert in memory is a few tensors (w13, w2 and, quantized, their scales) laid out back to back
in one flat byte buffer (`ExpertLayout`): the unit the disk tier reads into a ring slot, the
pager's host store holds and the device ring receives. Two sources give the byte ranges:

- `checkpoint_source`: straight from the checkpoint's safetensors files (offsets from their
  headers), no conversion pass. Possible when the engine computes on the checkpoint's own
  row-major tensors in their own dtype (torch GEMMs): gate and up land side by side as w13.
- `ExpertFile`: the packed CPU kernels want panels (and int8/int4 when asked), so a one-time
  expert file holds every expert already converted, each at an aligned offset so one O_DIRECT
  read lands it ready to use. It is built from the checkpoint one expert at a time (bounded
  memory), written under a temporary name and renamed, beside a JSON layout whose key covers
  the checkpoint files (name, size, mtime), the storage and the layout version: a changed
  checkpoint or setting builds a new file, never reuses a stale one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from moe_engine.io import atomic_path, default_cache_dir, exclusive_lock, write_text_atomic
from moe_engine.model.arch import NameTable
from moe_engine.model.loader import (CONVERTED_LAYOUTS, dequantized, expert_clamp,
                                     fused_expert_parts, safetensors_files, swiglu_weights)
from moe_engine.model.spec import ModelSpec
from moe_engine.model.weights import ExpertWeights, SwigluClamp
from moe_engine.offload.disk import (DirectReader, DiskRead, Extent, FileIdentity,
                                     align_up, file_identity, read_bytes)

log = logging.getLogger(__name__)

EXPERT_FILE_VERSION = 1
_FIELDS = ("w13", "w2", "s13", "s2", "b13", "b2")
_TENSOR_ALIGN = 64  # each tensor of an expert starts on a cache line (vector loads)
# U8: MXFP4 codes and scales
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "U8": torch.uint8}
# int32: bf16p's words of bf16 pairs (engine.matmul_precision=medium); uint32: bf16x3's (high)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32",
                torch.uint32: "uint32"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of an expert: its field in ExpertWeights, dtype, shape, byte offset."""

    field: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert's tensors sit in a flat byte buffer of `nbytes` (a multiple of ALIGN, so
    consecutive experts in a file or a ring stay aligned for O_DIRECT), and the activation
    its views compute (GPT-OSS's clamp, which is no tensor)."""

    slots: tuple[TensorSlot, ...]
    nbytes: int
    clamp: Optional[SwigluClamp] = None

    @classmethod
    def of(cls, expert: ExpertWeights) -> "ExpertLayout":
        slots, at = [], 0
        for name in _FIELDS:
            t = getattr(expert, name)
            if t is None:
                continue
            at = align_up(at, _TENSOR_ALIGN)
            slots.append(TensorSlot(name, _DTYPE_NAMES[t.dtype], tuple(t.shape), at))
            at += t.nbytes
        return cls(tuple(slots), align_up(at), expert.clamp)

    def view(self, flat: torch.Tensor) -> ExpertWeights:
        """The expert stored in `flat` (uint8, at least nbytes), as zero-copy tensor views."""
        parts = {}
        for s in self.slots:
            parts[s.field] = flat[s.offset:s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)
        return ExpertWeights(**parts, clamp=self.clamp)

    def write(self, expert: ExpertWeights, flat: torch.Tensor) -> None:
        """Copy `expert` (of this layout) into `flat`."""
        for s in self.slots:
            t = getattr(expert, s.field)
            if tuple(t.shape) != s.shape or _DTYPE_NAMES[t.dtype] != s.dtype:
                raise ValueError(f"expert tensor {s.field} {tuple(t.shape)} {t.dtype} does not "
                                 f"match the layout's {s.shape} {s.dtype}")
            flat[s.offset:s.offset + s.nbytes].view(t.dtype).view(s.shape).copy_(t)

    def to_json(self) -> dict:
        d = {"nbytes": self.nbytes,
             "slots": [{"field": s.field, "dtype": s.dtype, "shape": list(s.shape),
                        "offset": s.offset} for s in self.slots]}
        if self.clamp is not None:
            d["clamp"] = {"alpha": self.clamp.alpha, "limit": self.clamp.limit}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ExpertLayout":
        clamp = SwigluClamp(**d["clamp"]) if d.get("clamp") else None
        return cls(tuple(TensorSlot(s["field"], s["dtype"], tuple(s["shape"]), s["offset"])
                         for s in d["slots"]), int(d["nbytes"]), clamp)


class ExpertSource:
    """Every expert's bytes on disk in one layout: `read(layer, expert)` is what lands a whole
    expert (at byte 0 of a buffer of `layout.nbytes`)."""

    def __init__(self, layout: ExpertLayout, reads: dict[tuple[int, int], DiskRead],
                 identities: dict[str, FileIdentity], kind: str):
        self.layout = layout
        self._reads = reads
        self.identities = identities  # the files the byte ranges were computed from
        self.kind = kind  # "checkpoint" | "expert-file"

    def read(self, layer: int, expert: int) -> DiskRead:
        return self._reads[(layer, expert)]

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._reads

    def keys(self) -> list[tuple[int, int]]:
        """Every (layer, expert) the source holds, in order."""
        return sorted(self._reads)

    def check(self, reader: DirectReader) -> None:
        """Fail now, naming the file, if a source file changed since the layout was taken."""
        for path, identity in self.identities.items():
            reader.expect(path, identity)

    def load(self, layer: int, expert: int, reader: DirectReader) -> ExpertWeights:
        """One expert read into its own new buffer (resident experts)."""
        read = self.read(layer, expert)
        return self.layout.view(read_bytes(read.extents, reader))


# ---------------------------------------------------------------- safetensors headers

@dataclass(frozen=True)
class TensorRef:
    """A tensor's bytes in a safetensors file."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def extent(self, dst_offset: int = 0) -> Extent:
        return Extent(self.path, self.offset, self.nbytes, dst_offset)

    def load(self, reader: DirectReader) -> torch.Tensor:
        return read_bytes([self.extent()], reader).view(self.dtype).view(self.shape)


def safetensors_header(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Name -> TensorRef of every tensor in a safetensors file, from its JSON header only."""
    path = str(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header size)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise ValueError(f"{path}: header of {n} bytes runs past the end of the file "
                             f"({size} bytes): truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: corrupt safetensors header ({exc})") from exc
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > size:
            raise ValueError(f"{path}: tensor {name} ends at byte {base + end}, past the end "
                             f"of the file ({size} bytes): the file is truncated")
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}; the disk tier "
                             f"reads {sorted(_SAFETENSORS_DTYPES)}")
        out[name] = TensorRef(path, dtype, tuple(info["shape"]), base + start, end - start)
    return out


def expert_tensors(model_dir: str | Path, spec: ModelSpec
                   ) -> dict[tuple[int, int], dict[str, TensorRef]]:
    """(layer, expert) -> {"w1", "w3", "w2"} or {"w13", "w2"} (the fused transformers-5
    layout, whose gate_up[e] already is [gate; up]) byte ranges in the checkpoint, or the slots
    of one of loader.CONVERTED_LAYOUTS (GPT-OSS's, Llama-4's; read_expert converts them)."""
    table = NameTable(spec.architecture)
    out: dict[tuple[int, int], dict[str, TensorRef]] = {}
    for path in safetensors_files(Path(model_dir)):
        for name, ref in safetensors_header(path).items():
            m = table.match(name)
            # Layers past the last are a multi-token-prediction module generation never runs.
            if m is None or m.scope not in ("expert", "fused") or m.layer >= spec.num_layers:
                continue
            if m.scope == "expert":
                out.setdefault((m.layer, m.expert), {})[m.slot] = ref
                continue
            per = ref.nbytes // ref.shape[0]
            for e in range(ref.shape[0]):
                part = TensorRef(ref.path, ref.dtype, ref.shape[1:], ref.offset + e * per, per)
                slot = {"gate_up": "w13", "down": "w2"}.get(m.slot, m.slot)
                out.setdefault((m.layer, e), {})[slot] = part
    for i in range(spec.num_layers):
        for e in range(spec.num_experts if spec.is_moe_layer(i) else 0):
            got = out.get((i, e), {})
            if not ({"w13", "w2"} <= got.keys() or {"w1", "w3", "w2"} <= got.keys()
                    or any(slots <= got.keys() for slots in CONVERTED_LAYOUTS)):
                raise ValueError(f"{model_dir}: layer {i} expert {e} incomplete "
                                 f"(found {sorted(got)})")
    return out


def read_expert(refs: dict[str, TensorRef], dtype: torch.dtype,
                reader: DirectReader, clamp: Optional[SwigluClamp] = None,
                keep_quantized: bool = False) -> ExpertWeights:
    """An expert's row-major w13 = [gate; up] and w2 from the checkpoint, cast to `dtype`
    (GPT-OSS's: de-interleaved and transposed as the loader does, with biases and `clamp`;
    MXFP4 codes and scales kept with keep_quantized, else dequantized to `dtype`; Llama-4's
    transposed)."""
    for slots in CONVERTED_LAYOUTS:
        if slots <= refs.keys():
            parts: dict[str, torch.Tensor] = {}
            for slot in sorted(slots):
                t = refs[slot].load(reader)
                parts.update(fused_expert_parts(slot, t.to(dtype) if t.is_floating_point() else t))
            mlp = swiglu_weights(parts, clamp=clamp)
            return mlp if keep_quantized else dequantized(mlp, dtype)
    if "w13" in refs:
        w13 = refs["w13"].load(reader)
    else:
        w13 = torch.cat([refs["w1"].load(reader), refs["w3"].load(reader)])
    return ExpertWeights(w13.to(dtype).contiguous(), refs["w2"].load(reader).to(dtype))


# ---------------------------------------------------------------- the two sources

def checkpoint_source(model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype
                      ) -> Optional[ExpertSource]:
    """The experts read in place from the checkpoint, or None when its tensors are not in
    `dtype` or not row-major [gate; up] (GPT-OSS's interleaved ones, Llama-4's transposed
    ones): the engine would have to convert them, use an ExpertFile."""
    refs = expert_tensors(model_dir, spec)
    if any(r.dtype != dtype for parts in refs.values() for r in parts.values()):
        return None  # (MXFP4's uint8 codes among them)
    if any(slots & parts.keys() for slots in CONVERTED_LAYOUTS for parts in refs.values()):
        return None
    proto = next(iter(refs.values()))
    w2 = proto["w2"]
    inter, hidden = w2.shape[1], w2.shape[0]
    layout = ExpertLayout.of(ExpertWeights(torch.empty(2 * inter, hidden, dtype=dtype,
                                                       device="meta"),
                                           torch.empty(hidden, inter, dtype=dtype,
                                                       device="meta")))
    w13_at, w2_at = (s.offset for s in layout.slots)
    reads = {}
    for key, parts in refs.items():
        if "w13" in parts:
            ext = [parts["w13"].extent(w13_at)]
        else:
            ext = [parts["w1"].extent(w13_at), parts["w3"].extent(w13_at + parts["w1"].nbytes)]
        reads[key] = DiskRead(tuple(ext) + (parts["w2"].extent(w2_at),))
    files = {r.path for parts in refs.values() for r in parts.values()}
    return ExpertSource(layout, reads, {p: file_identity(p) for p in files}, "checkpoint")


class ExpertFile:
    """The one-time converted expert file: `open_or_build` returns its ExpertSource."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.data = directory / "experts.bin"
        self.index = directory / "experts.json"

    @staticmethod
    def key(model_dir: str | Path, spec: ModelSpec, fmt: str) -> str:
        """Cache key of the converted experts: checkpoint files (name, size, mtime), the
        architecture, the format (storage + layout) and the file layout's version."""
        files = [(p.name, st.st_size, st.st_mtime_ns)
                 for p in safetensors_files(Path(model_dir)) for st in [p.stat()]]
        blob = json.dumps({"files": files, "dir": str(Path(model_dir).resolve()),
                           "arch": spec.architecture, "format": fmt,
                           "version": EXPERT_FILE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    @classmethod
    def open_or_build(cls, model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype,
                      fmt: str, convert: Callable[[ExpertWeights], ExpertWeights],
                      cache_dir: Optional[str | Path] = None,
                      keep_quantized: bool = False) -> ExpertSource:
        """The expert file of (checkpoint, fmt) under the cache dir, built first if missing.

        `convert` maps a row-major expert in `dtype` (MXFP4 codes and scales as stored, with
        keep_quantized) to the engine's form of it (packing, quantization); `fmt` names that
        form in the cache key.
        """
        key = cls.key(model_dir, spec, fmt)
        f = cls(Path(cache_dir or default_cache_dir()) / "experts" / key)
        # Generate jobs of several shards may start at once: one builds, the others wait for
        # it and read its file (two builds would swap the file under a reader).
        with exclusive_lock(f.directory / ".lock"):
            if not f.index.exists() or not f.data.exists():
                f._build(model_dir, spec, dtype, fmt, convert, keep_quantized)
        return f._source()

    def _source(self) -> ExpertSource:
        meta = json.loads(self.index.read_text())
        identity = FileIdentity(**meta["identity"])
        if file_identity(self.data) != identity:
            raise ValueError(f"{self.data} does not match its index {self.index} (changed "
                             f"after it was written); delete the directory to rebuild it")
        layout = ExpertLayout.from_json(meta["layout"])
        path = str(self.data)
        reads = {(int(i), int(e)): DiskRead((Extent(path, off, layout.nbytes, 0),))
                 for i, e, off in meta["offsets"]}
        return ExpertSource(layout, reads, {path: identity}, "expert-file")

    def _build(self, model_dir, spec: ModelSpec, dtype: torch.dtype, fmt: str,
               convert: Callable[[ExpertWeights], ExpertWeights],
               keep_quantized: bool = False) -> None:
        refs = expert_tensors(model_dir, spec)
        keys = sorted(refs)
        reader = DirectReader()
        log.info("writing the expert file %s (%d experts, format %s) once", self.data,
                 len(keys), fmt)
        try:
            layout, offsets = None, []
            with atomic_path(self.data) as tmp:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    for n, key in enumerate(_progress(keys, "expert file")):
                        expert = convert(read_expert(refs[key], dtype, reader,
                                                     expert_clamp(spec), keep_quantized))
                        layout = layout or ExpertLayout.of(expert)
                        buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
                        layout.write(expert, buf)
                        _write_all(fd, buf.numpy(), n * layout.nbytes)
                        offsets.append([key[0], key[1], n * layout.nbytes])
                        del expert, buf
                        _return_free_memory()
                    os.fsync(fd)
                    # The written pages would otherwise sit in the page cache, outside the
                    # budget, until memory pressure evicts them.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        finally:
            reader.close()
        meta = {"version": EXPERT_FILE_VERSION, "format": fmt, "model_dir": str(model_dir),
                "layout": layout.to_json(), "offsets": offsets,
                "identity": file_identity(self.data).__dict__}
        write_text_atomic(self.index, json.dumps(meta))


def _progress(items: list, desc: str):
    """A progress bar on stderr (a checkpoint of hundreds of GB converts for minutes): in a log
    file, not a terminal, one line every 30 s rather than a line per refresh."""
    from tqdm import tqdm

    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(items, desc=desc, unit="expert", file=sys.stderr, mininterval=interval,
                ascii=True, dynamic_ncols=False)


def _write_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written (a single call may write less, e.g. past 2 GB)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _return_free_memory() -> None:
    """Give the allocator's free pages back to the kernel: a conversion's temporaries (several
    expert-sized tensors per expert) would otherwise stay in the process's RSS, outside the host
    budget the rest of the job keeps."""
    from moe_engine.host_alloc import libc_function

    trim = libc_function("malloc_trim")
    if trim is not None:  # glibc's
        trim(0)


__all__ = ["ExpertFile", "ExpertLayout", "ExpertSource", "TensorRef", "TensorSlot",
           "checkpoint_source", "expert_tensors", "read_expert", "safetensors_header"]
