"""Writing directories so that a failure never leaves a half-written result behind."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_dir(target: str | Path):
    """Yield a temporary directory beside `target`; on success it replaces `target`, on error it vanishes."""
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"output path {str(target)!r} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def require_dir(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {str(path)!r} is not a directory")
    return path


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`, or a ValueError naming the file and `what` it should be."""
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable or corrupt {what} ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is not a JSON object")
    return data
