"""Peak memory of this process: on the host the kernel's high-water mark of resident memory (VmHWM; ru_maxrss where
there is no /proc), on the GPU torch's largest allocation so far."""
from __future__ import annotations

import sys


def peak_host_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024          # bytes on macOS, KiB elsewhere


def peak_device_bytes() -> int | None:
    """Torch's peak GPU allocation on the current device; None when CUDA is not in use (neither torch nor CUDA is
    started here)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated()


def peak_memory_note() -> str:
    """`peak memory: host 1.2 GiB, GPU 4.5 GiB` (so far in this process), or "" where nothing can be read."""
    parts = [f"{what} {value / 2**30:.2f} GiB" for what, value in (("host", peak_host_bytes()),
                                                                    ("GPU", peak_device_bytes())) if value is not None]
    return f"peak memory: {', '.join(parts)}" if parts else ""
