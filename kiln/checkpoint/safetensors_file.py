"""safetensors files read and written a tensor at a time.

The format: an 8-byte little-endian header length, a JSON header (`__metadata__`, then name → {dtype, shape,
data_offsets}) padded with spaces to a multiple of 8, then the tensors' bytes. `TensorWriter` lays a file out as
safetensors' own `save_file` does (tensors ordered by dtype, widest first, then by name; the same header bytes), so
that a file written a tensor at a time, in any order, equals one written whole. `TensorReader` reads each tensor
with plain file reads into a buffer of its own: a memory map would keep every page it touched counted in the
process's memory for as long as it is open.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kiln.utils.checksum import CHUNK, ChunkHasher, chunk_digest, combined, file_digest

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
               torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# safetensors' order of dtypes in a file, first to last
_FILE_ORDER = ["U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8",
               "U8", "BOOL"]
_MAX_IO = 1 << 30          # bytes per read or write call (Linux moves at most 2 GiB - 4 KiB in one)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def file_layout(specs: dict, metadata: dict[str, str] | None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(header bytes with its length prefix, name → (start, end) in the data section) of a file holding tensors of
    `specs` (name → object with .shape and .dtype), as save_file lays it out."""
    order = sorted(specs, key=lambda n: (_FILE_ORDER.index(DTYPE_NAMES[specs[n].dtype]), n))
    header: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets, start = {}, 0
    for name in order:
        spec = specs[name]
        end = start + tensor_bytes(tuple(spec.shape), spec.dtype)
        header[name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape), "data_offsets": [start, end]}
        offsets[name] = (start, end)
        start = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


class TensorWriter:
    """Writes a safetensors file whose tensors (and their shapes and dtypes) are known before any is made; each
    tensor is written where it belongs as soon as it is given, in any order, and its bytes are hashed as the
    file's 64 MiB chunks complete (kiln.utils.checksum)."""

    def __init__(self, path: str | Path, specs: dict, metadata: dict[str, str] | None = None):
        self.path, self.specs = Path(path), dict(specs)
        header, self.offsets = file_layout(self.specs, metadata)
        self.data_start = len(header)
        size = self.data_start + (max(end for _, end in self.offsets.values()) if self.offsets else 0)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.hasher = ChunkHasher(self.path, size)
        os.ftruncate(self.fd, size)
        self.written: set[str] = set()
        self._write_at(header, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"{self.path.name}: unexpected tensor {name!r}")
        if name in self.written:
            raise ValueError(f"{self.path.name}: tensor {name!r} written twice")
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            raise ValueError(f"{self.path.name}: tensor {name!r} is {tuple(tensor.shape)} "
                             f"{str(tensor.dtype).removeprefix('torch.')}, expected {tuple(spec.shape)} "
                             f"{str(spec.dtype).removeprefix('torch.')}")
        data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        self._write_at(memoryview(data), self.data_start + self.offsets[name][0])
        self.written.add(name)

    def _write_at(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        start = offset
        while view:
            n = os.pwrite(self.fd, view[:_MAX_IO], offset)
            view, offset = view[n:], offset + n
        self.hasher.written(start, offset - start)

    def close(self) -> str:
        """Finish the file (every tensor must have been written); returns its digest."""
        os.close(self.fd)
        missing = [n for n in self.specs if n not in self.written]
        if missing:
            raise ValueError(f"{self.path.name}: tensor {missing[0]!r} was never written ({len(missing)} in all)")
        return self.hasher.digest()

    def abort(self) -> None:
        os.close(self.fd)
        self.hasher.abort()


def write_tensors(path: str | Path, weights, metadata: dict[str, str] | None = None) -> str:
    """Write `weights` (a dict of tensors, or kiln.checkpoint.lazy weights, made a unit at a time) to a safetensors
    file laid out as save_file lays it out; returns the file's digest."""
    from .lazy import weight_specs

    writer = TensorWriter(path, weight_specs(weights), metadata)
    try:
        for name, tensor in weights.items():
            writer.write(name, tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


class TensorReader:
    """The tensors of one safetensors file, each read on request into its own buffer. The file stays open, so that
    it can be read after it was replaced or deleted."""

    def __init__(self, path: str | Path):
        self.path, self.fd = Path(path), -1
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.metadata, self.entries, self.data_start = _read_header(self.fd, self.path)
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype, _, _ = self.entries[name]
        return shape, dtype

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        shape, dtype, start, end = self.entries[name]
        buffer = torch.empty(end - start, dtype=torch.uint8)
        view, offset = memoryview(buffer.numpy()), self.data_start + start
        while view:
            n = os.preadv(self.fd, [view[:_MAX_IO]], offset)
            if n == 0:
                raise ValueError(f"{self.path}: corrupt or truncated safetensors file (tensor {name!r} ends past the "
                                 "end of the file)")
            view, offset = view[n:], offset + n
        tensor = buffer.view(dtype).reshape(shape)
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    def read_all(self, device: str | torch.device = "cpu", hash_file: bool = False,
                 threads: int | None = None) -> tuple[dict[str, torch.Tensor], str | None]:
        """(every tensor on `device`, the file's digest as kiln.utils.checksum computes it, or None unless
        hash_file): the file is read once, its 64 MiB chunks by several threads at once, each chunk hashed as it
        arrives. On the CPU the reads land in the tensors themselves; on a GPU in a pinned buffer per thread,
        copied to the tensors asynchronously. A file whose tensors do not tile its data section (not one a Kiln
        or safetensors writer makes) is read a tensor at a time and hashed separately."""
        device = torch.device(device)
        size = os.fstat(self.fd).st_size
        ranges = sorted((start, end, name) for name, (_, _, start, end) in self.entries.items())
        tiled = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and \
            (not ranges or (ranges[0][0] == 0 and self.data_start + ranges[-1][1] == size))
        if not tiled:
            return ({name: self.read(name, device) for name in self.entries},
                    file_digest(self.path) if hash_file else None)
        flat = {name: torch.empty(end - start, dtype=torch.uint8, device=device) for start, end, name in ranges}
        pieces = [(0, self.data_start, None)] + [(self.data_start + a, self.data_start + b, flat[n])
                                                 for a, b, n in ranges]
        workers = threads or min(16, os.cpu_count() or 1)
        staging = _Staging(device) if device.type == "cuda" else None
        with ThreadPoolExecutor(max(1, workers)) as pool:
            digests = list(pool.map(lambda start: self._read_chunk(start, min(size, start + CHUNK), pieces,
                                                                    hash_file, staging), range(0, size, CHUNK)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tensors = {name: flat[name].view(dtype).reshape(shape) for name, (shape, dtype, _, _) in self.entries.items()}
        return tensors, combined(digests) if hash_file else None

    def _read_chunk(self, start: int, end: int, pieces, hashed: bool, staging) -> bytes | None:
        """Bytes [start, end) of the file into the parts of `pieces` ((file start, file end, flat tensor or None
        for bytes read only to be hashed)) they overlap; their digest when `hashed`."""
        overlapping = [(max(a, start), min(b, end), a, t) for a, b, t in pieces if a < end and b > start]
        if staging is not None:
            buffer = staging.buffer(end - start)
            self._fill([memoryview(buffer.numpy())[:end - start]], start)
            stream = staging.stream()
            with torch.cuda.stream(stream):
                for lo, hi, a, tensor in overlapping:
                    if tensor is not None:
                        tensor[lo - a:hi - a].copy_(buffer[lo - start:hi - start], non_blocking=True)
            digest = chunk_digest([memoryview(buffer.numpy())[:end - start]]) if hashed else None
            stream.synchronize()            # the buffer is this thread's next chunk's
            return digest
        views = [memoryview(bytearray(hi - lo)) if tensor is None else memoryview(tensor.numpy())[lo - a:hi - a]
                 for lo, hi, a, tensor in overlapping]
        self._fill(views, start)
        return chunk_digest(views) if hashed else None

    def _fill(self, views: list[memoryview], offset: int) -> None:
        """Read the file from `offset` into `views`, in order, whole."""
        views = list(views)
        while views:
            n = os.preadv(self.fd, views[:64], offset)
            if n == 0:
                raise ValueError(f"{self.path}: corrupt or truncated safetensors file (it ends at byte {offset})")
            offset += n
            while n:
                step = min(n, len(views[0]))
                views[0], n = views[0][step:], n - step
                if not views[0]:
                    views.pop(0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Staging:
    """A pinned host buffer and a CUDA stream for each reading thread."""

    def __init__(self, device: torch.device):
        self.device, self.local = device, threading.local()

    def buffer(self, nbytes: int) -> torch.Tensor:
        if getattr(self.local, "buffer", None) is None:
            self.local.buffer = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
        return self.local.buffer[:nbytes]

    def stream(self) -> torch.cuda.Stream:
        if getattr(self.local, "stream", None) is None:
            self.local.stream = torch.cuda.Stream(self.device)
        return self.local.stream


def _read_header(fd: int, path: Path):
    """(metadata, name → (shape, dtype, start, end), start of the data) of a safetensors file, every entry checked
    against the file's size; a damaged file is a ValueError saying "corrupt or truncated"."""
    def corrupt(why: str) -> ValueError:
        return ValueError(f"{path}: corrupt or truncated safetensors file ({why})")

    size = os.fstat(fd).st_size
    if size < 8:
        raise corrupt(f"{size} bytes, shorter than its header")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > size - 8 or length > 100 << 20:
        raise corrupt(f"a {length}-byte header in a {size}-byte file")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as err:
        raise corrupt(f"unreadable header: {err}") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size, entries = size - 8 - length, {}
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"]), \
                entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {name!r} has an unreadable entry {entry!r}") from None
        if not 0 <= start <= end <= data_size or end - start != tensor_bytes(shape, dtype):
            raise corrupt(f"tensor {name!r} of shape {list(shape)} claims bytes {start}..{end} of a "
                          f"{data_size}-byte data section")
        entries[name] = (shape, dtype, start, end)
    return metadata, entries, 8 + length


def file_weights(path: str | Path, device: str | torch.device = "cpu"):
    """The tensors of a safetensors file as LazyWeights: each read (onto `device`) when it is used, one unit per
    tensor in layer order; the header is read and checked now."""
    from .lazy import LazyWeights, TensorSpec, unit_key

    reader = TensorReader(path)
    specs = {name: TensorSpec(*reader.spec(name)) for name in reader.keys()}
    units = [[name] for name in sorted(specs, key=lambda n: (unit_key(n), n))]
    return LazyWeights(specs, units, lambda names: {names[0]: reader.read(names[0], device)}, str(path), device)
