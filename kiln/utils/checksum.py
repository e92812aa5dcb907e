"""Checksums of the files of engines and checkpoints, written at save and verified at load.

A file's digest is SHA-256 over the SHA-256 digests of its 64 MiB chunks: the chunks are hashed by several
threads at once (hashlib releases the GIL), so that verifying a 100 GB engine is bound by the disk, not one core.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALGORITHM = "sha256-of-64MiB-chunks"
CHUNK = 64 << 20
_READ = 8 << 20
_RANK_WEIGHTS = re.compile(r"rank\d+\.safetensors")


def file_digest(path: Path, threads: int | None = None) -> str:
    size = path.stat().st_size
    threads = threads or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        digests = pool.map(lambda start: _chunk_digest(path, start, min(CHUNK, size - start)), range(0, size, CHUNK))
        return combined(digests)


def combined(chunk_digests) -> str:
    """A file's digest from its chunks' digests (in file order)."""
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def chunk_digest(pieces) -> bytes:
    """The digest of one chunk given as buffers that hold its bytes in order."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.digest()


class ChunkHasher:
    """A file's digest (as file_digest computes it) taken while the file is written in any order: each 64 MiB
    chunk is hashed by a thread as soon as all its bytes are written, read back while the system still caches
    them, instead of the whole file being read again once it is finished."""

    def __init__(self, path: Path, size: int, threads: int | None = None):
        self.path, self.size = Path(path), size
        self.missing = [min(CHUNK, size - start) for start in range(0, size, CHUNK)]
        self.pool = ThreadPoolExecutor(threads or min(4, os.cpu_count() or 1))
        self.digests: list = [None] * len(self.missing)

    def written(self, start: int, length: int) -> None:
        """Bytes [start, start + length) of the file are written (each byte once)."""
        end = start + length
        while start < end:
            index = start // CHUNK
            stop = min(end, (index + 1) * CHUNK)
            self.missing[index] -= stop - start
            if self.missing[index] == 0:
                chunk_start = index * CHUNK
                self.digests[index] = self.pool.submit(_chunk_digest, self.path, chunk_start,
                                                       min(CHUNK, self.size - chunk_start))
            start = stop

    def digest(self) -> str:
        try:
            if any(d is None for d in self.digests):
                raise ValueError(f"{self.path}: hashed before all of it was written")
            return combined(d.result() for d in self.digests)
        finally:
            self.pool.shutdown()

    def abort(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def _chunk_digest(path: Path, start: int, length: int) -> bytes:
    digest, buffer = hashlib.sha256(), bytearray(min(_READ, length))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0:
            n = f.readinto(memoryview(buffer)[:min(_READ, length)])
            if n == 0:
                break
            digest.update(memoryview(buffer)[:n])
            length -= n
    return digest.digest()


def directory_checksums(directory: Path, skip: tuple[str, ...] = ("config.json",),
                        known: dict[str, str] | None = None) -> dict:
    """{"algorithm", "files": {relative path: {"bytes", "digest"}}} of every file under `directory` but `skip`;
    `known` gives the digests of files already hashed while they were written (relative path → digest)."""
    known = known or {}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in skip)
    return {"algorithm": ALGORITHM,
            "files": {(name := p.relative_to(directory).as_posix()): {"bytes": p.stat().st_size,
                                                                      "digest": known.get(name) or file_digest(p)}
                      for p in files}}


def verify_checksums(directory: Path, checksums: dict | None, what: str, own_weights: str,
                     digest_own_weights: bool = True) -> str | None:
    """Check the files `checksums` lists against their recorded sizes and digests, but the weights of ranks other
    than `own_weights` (their own loads check them); a missing, truncated or altered file is an error naming it.
    With digest_own_weights=False only the size of `own_weights` is checked and its recorded digest returned, for
    the reader to check as it reads the file (check_digest). A directory written before checksums existed is loaded
    with a one-line notice (None returned)."""
    if checksums is None:
        print(f"note: {directory} was written without checksums (by an older Kiln): its files are not verified",
              file=sys.stderr)
        return None
    own_digest = None
    for name, recorded in _recorded_files(directory, checksums).items():
        if _RANK_WEIGHTS.fullmatch(name) and name != own_weights:
            continue
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"{what} file {path} is missing")
        if path.stat().st_size != recorded.get("bytes"):
            raise ValueError(f"{path}: corrupt or truncated {what} file ({path.stat().st_size} bytes, "
                             f"{recorded.get('bytes')} written)")
        if name == own_weights and not digest_own_weights:
            own_digest = recorded.get("digest") or ""      # none recorded: no file matches it, as below
        else:
            check_digest(path, file_digest(path), recorded.get("digest"), what)
    return own_digest


def check_digest(path: Path, digest: str, recorded: str | None, what: str) -> None:
    if digest != recorded:
        raise ValueError(f"{path}: corrupt {what} file (its checksum differs from the one written with it); "
                         "copy or build it again (--skip_checksum loads it anyway)")


def _recorded_files(directory: Path, checksums) -> dict[str, dict]:
    algorithm = checksums.get("algorithm") if isinstance(checksums, dict) else checksums
    if algorithm != ALGORITHM:
        raise ValueError(f"{directory}/config.json: unknown checksum algorithm {algorithm!r} (this Kiln uses "
                         f"{ALGORITHM!r})")
    files = checksums.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise ValueError(f"{directory}/config.json: corrupt checksums (no file list)")
    return files
