"""Writing directories so that a failure or a kill never leaves a half-written result, nor loses the old one.

A directory is written under a temporary name beside its target, `.{name}.tmp-{pid}-{random}`, then swapped in:
on Linux in one step (renameat2 RENAME_EXCHANGE), elsewhere by renaming the old directory to
`.{name}.old-{pid}-{random}` first. A writer killed between those two renames leaves the target missing and the
old directory under that name: the next write of the target, or the next load through `require_dir`, renames it
back. Temporary directories whose process is gone are removed by the next write of the same target.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@contextlib.contextmanager
def atomic_dir(target: str | Path):
    """Yield a new directory beside `target`; on success it replaces `target`, on error it vanishes."""
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"output path {str(target)!r} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(target)
    tmp = _scratch_name(target, "tmp")
    tmp.mkdir()                              # mode 0777 less the user's umask, as any directory they make
    try:
        yield tmp
        _files_as_directory(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_in(tmp, target)


def _swap_in(new: Path, target: Path) -> None:
    if not target.exists():
        new.rename(target)
        return
    if _exchange(new, target):               # `new` now holds the old directory
        shutil.rmtree(new, ignore_errors=True)
        return
    old = _scratch_name(target, "old")
    target.rename(old)                       # killed from here to the next rename: recover_dir restores `old`
    new.rename(target)
    trash = _scratch_name(target, "tmp")
    old.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _scratch_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _files_as_directory(directory: Path) -> None:
    """Files take the directory's permissions less execute (safetensors writes 0600 whatever the umask)."""
    mode = directory.stat().st_mode & 0o666
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def recover_dir(target: str | Path) -> None:
    """Undo what killed writers of `target` left: a missing target gets its old directory back, and their
    temporary directories are removed (only those whose process is gone)."""
    target = Path(target).absolute()
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-(\d+)-[0-9a-f]+")
    try:
        entries = [(p, m[1]) for p in target.parent.iterdir()
                   if (m := pattern.fullmatch(p.name)) and not _alive(int(m[2]))]
    except OSError:
        return
    olds = sorted((p for p, kind in entries if kind == "old"), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists():
        with contextlib.suppress(OSError):
            olds[-1].rename(target)
            print(f"note: {target} restored from {olds[-1].name}, left by a write that was killed", file=sys.stderr)
    for path, _ in entries:
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kiln_format(path: Path) -> str | None:
    """The `kiln_format` of a Kiln output directory's config.json; None for anything else."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("kiln_format") if isinstance(data, dict) else None


def check_output_dir(target: str | Path, kiln_kind: str, overwrite: bool = False, inputs=()) -> Path:
    """`target` may be written: it is absent, empty, a Kiln output of the same kind (its config.json says
    kiln_format=`kiln_kind`), or `overwrite` is given; and it is never one of `inputs`, inside one, or around one.
    Otherwise a ValueError says why. Runs before any work, so that nothing is computed for nothing."""
    target = Path(target).absolute()
    recover_dir(target)
    for source in inputs:
        source = Path(source).absolute()
        if target == source or target in source.parents or source in target.parents:
            raise ValueError(f"output directory {str(target)!r} would overwrite the input {str(source)!r}; "
                             "write the output elsewhere")
    if not target.exists():
        return target
    if not target.is_dir():
        raise ValueError(f"output path {str(target)!r} exists and is not a directory")
    if overwrite or not any(target.iterdir()) or kiln_format(target) == kiln_kind:
        return target
    raise ValueError(f"output directory {str(target)!r} is not empty and is not a {kiln_kind} (its files would "
                     "be deleted): choose another directory, or pass --overwrite (overwrite=True) to replace it")


def exists_or_recovered(path: str | Path) -> bool:
    """`path` exists, or it is an output whose writer was killed between its two renames and is now restored."""
    if not Path(path).exists():
        recover_dir(path)
    return Path(path).exists()


def require_dir(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not exists_or_recovered(path):
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} is not a directory")
    return path


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`, or a ValueError naming the file and `what` it should be."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable or corrupt {what} ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is not a JSON object")
    return data
