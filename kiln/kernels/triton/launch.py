"""Programmatic dependent launch (Hopper): every kernel of the package is launched with launch_pdl on sm_90+, so it
may start while the kernel before it is still running (inside CUDA graphs too): its programs are resident when the
previous grid ends, and the decode GEMV has its first weight loads in flight. `wait_for_inputs` (griddepcontrol.wait)
must therefore come before any load of what an earlier kernel wrote and before any store; loads of constant weights
may precede it. TritonOptions.pdl (PluginConfig.programmatic_dependent_launch) turns it off."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                                   # Triton < 3.4: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def pdl_supported() -> bool:
    """Triton has the instructions, kernels are compiled (not interpreted) and the GPU is sm_90 or newer."""
    return (gdc_wait is not None and os.environ.get("TRITON_INTERPRET", "0") == "0" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def shared_memory(device: torch.device | None) -> int:
    """Bytes of shared memory one program may hold on `device` (227 KB on an H100/H200, ~100 KB on GeForce cards;
    no limit off the GPU: Triton's interpreter)."""
    if device is None or device.type != "cuda":
        return 1 << 62
    return _shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _shared_memory(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def launch_options(pdl: bool = True) -> dict:
    """Launch options of every kernel: the PDL constexpr and launch_pdl, together (PDL where supported)."""
    return {"PDL": True, "launch_pdl": True} if pdl and pdl_supported() else {"PDL": False}


def launch_args(launch: dict | None) -> dict:
    """A wrapper's `launch` argument: the options TritonOps chose, or None for launch_options()'s."""
    return launch_options() if launch is None else launch


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible, then let the next kernel
    start launching."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
