"""2:4 sparse products on cuSPARSELt with cached plans. torch's `_cslt_sparse_mm` builds (and destroys) a
cuSPARSELt plan on every call, host work that costs more than the product itself for the narrower projections of a
prompt step; here libcusparseLt (the copy torch loaded) is called through ctypes and each problem shape's plan is
built once. The weight is the buffer torch's `_cslt_compress` made (the `packed` of its cuSPARSELt semi-structured
tensor)."""
from __future__ import annotations

import ctypes
import glob
import os
import threading
import warnings

import torch

OPAQUE = 1024           # bytes of cuSPARSELt's opaque structs (512 in 0.10, up to 1024 in older releases), aligned 16
ALIGNMENT = 16          # bytes: every matrix's start, as its descriptors declare
MIN_VERSION = 502       # 0.5.2: compute types {32I, 16F, 32F} (earlier releases numbered them otherwise)
MAX_PLANS = 4096        # a few KB of host memory each: every token count (padded to 8) up to 32k, times 4 shapes
MAX_BUCKET = 4096       # token counts from here on share one searched algorithm
PAD_TOKENS = 8          # dense operands' rows a multiple of 8 (16-bit values), as torch pads them

ORDER_COL, ORDER_ROW = 1, 2
NON_TRANSPOSE, TRANSPOSE = 0, 1
SPARSITY_50_PERCENT = 0
COMPUTE_32F = 2
ALG_DEFAULT = 0
ALG_CONFIG_ID, SPLIT_K, SPLIT_K_MODE = 0, 3, 4      # cusparseLtMatmulAlgAttribute_t
# cudaDataType CUDA_R_16BF. float16 stays on torch's calls: on an H100 (torch 2.11's libcusparseLt, CUDA 13) the
# search over a float16 problem failed with an internal error and left the CUDA context faulted.
DATA_TYPES = {torch.bfloat16: 14}


class _Opaque:
    """One of cuSPARSELt's opaque structs: zeroed bytes at a 16-byte aligned address."""

    def __init__(self):
        self.buffer = ctypes.create_string_buffer(OPAQUE + ALIGNMENT)
        address = ctypes.addressof(self.buffer)
        self.ptr = ctypes.c_void_p(address + (-address) % ALIGNMENT)


class _Library:
    """libcusparseLt with its argument types declared, and one handle."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i64, u32, enum, ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p
        signatures = {
            "cusparseLtInit": [ptr], "cusparseLtGetVersion": [ptr, ptr],
            "cusparseLtDenseDescriptorInit": [ptr, ptr, i64, i64, i64, u32, enum, enum],
            "cusparseLtStructuredDescriptorInit": [ptr, ptr, i64, i64, i64, u32, enum, enum, enum],
            "cusparseLtMatmulDescriptorInit": [ptr, ptr, enum, enum, ptr, ptr, ptr, ptr, enum],
            "cusparseLtMatmulAlgSelectionInit": [ptr, ptr, ptr, enum],
            "cusparseLtMatmulAlgSetAttribute": [ptr, ptr, enum, ptr, ctypes.c_size_t],
            "cusparseLtMatmulAlgGetAttribute": [ptr, ptr, enum, ptr, ctypes.c_size_t],
            "cusparseLtMatmulPlanInit": [ptr, ptr, ptr, ptr],
            "cusparseLtMatmulGetWorkspace": [ptr, ptr, ptr],
            "cusparseLtMatmul": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int32],
            "cusparseLtMatmulSearch": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int32],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        lib.cusparseLtGetErrorString.argtypes, lib.cusparseLtGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        self.handle = _Opaque()
        self.check("cusparseLtInit", self.handle.ptr)
        version = ctypes.c_int()
        self.check("cusparseLtGetVersion", self.handle.ptr, ctypes.byref(version))
        self.version = version.value

    def check(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status:
            message = self.lib.cusparseLtGetErrorString(status)
            raise RuntimeError(f"cuSPARSELt {name} failed with status {status}: "
                               f"{message.decode() if message else 'unknown error'}")


class _Plan:
    """x W^T for one (weight rows m, inputs k, tokens n, dtype): W (m × k, row-major) is the sparse operand A; x
    (n × k, row-major) is B stored transposed; D = W x^T is written column-major, which is x W^T row-major.
    `algorithm`: (config id, split-K, split-K mode) to set, or None for cuSPARSELt's defaults."""

    def __init__(self, lib: _Library, m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                 algorithm: tuple[int, int, int] | None = None):
        h, kind = lib.handle.ptr, DATA_TYPES[dtype]
        self.lib, self.structs = lib, [_Opaque() for _ in range(6)]
        a, b, d, matmul, selection, plan = (s.ptr for s in self.structs)
        lib.check("cusparseLtStructuredDescriptorInit", h, a, m, k, k, ALIGNMENT, kind, ORDER_ROW,
                  SPARSITY_50_PERCENT)
        lib.check("cusparseLtDenseDescriptorInit", h, b, n, k, k, ALIGNMENT, kind, ORDER_ROW)
        lib.check("cusparseLtDenseDescriptorInit", h, d, m, n, m, ALIGNMENT, kind, ORDER_COL)
        lib.check("cusparseLtMatmulDescriptorInit", h, matmul, NON_TRANSPOSE, TRANSPOSE, a, b, d, d, COMPUTE_32F)
        lib.check("cusparseLtMatmulAlgSelectionInit", h, selection, matmul, ALG_DEFAULT)
        if algorithm is not None:
            config, split_k, split_k_mode = algorithm
            self._set(ALG_CONFIG_ID, config)
            if split_k not in (0, 1):
                self._set(SPLIT_K, split_k)
                if split_k_mode > 0:
                    self._set(SPLIT_K_MODE, split_k_mode)
        lib.check("cusparseLtMatmulPlanInit", h, plan, matmul, selection)
        size = ctypes.c_size_t()
        lib.check("cusparseLtMatmulGetWorkspace", h, plan, ctypes.byref(size))
        self.workspace = _workspace(device, size.value)
        self.shape, self.dtype, self.algorithm = (n, m), dtype, algorithm
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, attribute: int, value: int) -> None:
        value = ctypes.c_int(value)
        self.lib.check("cusparseLtMatmulAlgSetAttribute", self.lib.handle.ptr, self.structs[4].ptr, attribute,
                       ctypes.byref(value), ctypes.sizeof(value))

    def _get(self, attribute: int) -> int:
        value = ctypes.c_int(0)
        self.lib.check("cusparseLtMatmulAlgGetAttribute", self.lib.handle.ptr, self.structs[4].ptr, attribute,
                       ctypes.byref(value), ctypes.sizeof(value))
        return value.value

    def _call(self, name: str, packed: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        self.lib.check(name, self.lib.handle.ptr, self.structs[5].ptr, ctypes.byref(self.alpha),
                       ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.byref(self.beta),
                       ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                       ctypes.c_void_p(self.workspace.data_ptr()), ctypes.byref(stream), 1)

    def run(self, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=x.device)
        self._call("cusparseLtMatmul", packed, x, out)
        return out

    def search(self, packed: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int]:
        """cuSPARSELt's timed search over its algorithms on these operands: (config id, split-K, split-K mode)
        of the fastest."""
        self._call("cusparseLtMatmulSearch", packed, x, torch.empty(self.shape, dtype=self.dtype, device=x.device))
        return self._get(ALG_CONFIG_ID), self._get(SPLIT_K), self._get(SPLIT_K_MODE)


_lock = threading.Lock()
_library: _Library | None | bool = None     # False: looked for and not usable
_plans: dict[tuple, _Plan] = {}
_algorithms: dict[tuple, tuple[int, int, int]] = {}   # (device, dtype, rows, inputs, token bucket) → searched
_workspaces: dict[torch.device, list[torch.Tensor]] = {}


def _workspace(device: torch.device, size: int) -> torch.Tensor:
    """A workspace of at least `size` bytes on `device`, shared by its plans (products run one at a time on the
    stream). A larger one replaces it for new plans; the old ones stay allocated, since CUDA graphs may hold them."""
    held = _workspaces.setdefault(device, [])
    if not held or held[-1].numel() < size:
        held.append(torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device))
    return held[-1]


def library() -> _Library | None:
    """The loaded libcusparseLt (torch's copy where it loaded one), or None where there is none or it is older
    than 0.5.2. Looked for once; every later call (one a sparse product) reads the answer without the lock."""
    global _library
    if _library is not None:
        return _library or None
    with _lock:
        if _library is None:
            _library = _load() or False
        return _library or None


def _load() -> _Library | None:
    if not torch.cuda.is_available():
        return None
    torch.backends.cusparselt.is_available()        # makes torch load its copy, when it has one
    candidates = ["libcusparseLt.so.0"]
    for path in torch.__path__:
        site = os.path.dirname(path)
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcusparseLt.so*")))
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cusparselt", "lib", "libcusparseLt.so*")))
    for name in candidates:
        try:
            lib = _Library(ctypes.CDLL(name))
        except (OSError, AttributeError, RuntimeError):
            continue
        return lib if lib.version >= MIN_VERSION and _agrees_with_torch(lib) else None
    return None


def _agrees_with_torch(lib: _Library) -> bool:
    """One small product through this binding equals the dense product; where it does not (a libcusparseLt whose
    interface differs from the one declared here), the sparse path stays on torch's calls, with a warning."""
    try:
        generator = torch.Generator(device="cuda").manual_seed(0)
        weight = torch.randn(64, 128, device="cuda", generator=generator)
        weight[:, 1::4] = weight[:, 2::4] = 0
        weight = weight.bfloat16()
        x = torch.randn(8, 128, device="cuda", generator=generator).bfloat16()
        got = _Plan(lib, 64, 128, 8, torch.bfloat16, x.device).run(torch._cslt_compress(weight), x).float()
        expected = x.float() @ weight.float().T
        if (got - expected).abs().max() <= 1e-2 * expected.abs().max():
            return True
        problem = "a wrong product"
    except RuntimeError as err:
        problem = str(err)
    warnings.warn(f"cuSPARSELt called directly gave {problem}; 2:4 sparse products use torch's calls instead")
    return False


def sparse_mm(packed: torch.Tensor, rows: int, x: torch.Tensor) -> torch.Tensor:
    """x W^T (tokens × rows) for x (tokens × inputs, bfloat16 on the GPU) and W the 2:4 sparse weight
    (rows × inputs) that `packed` holds compressed. Each token count (padded to 8) gets a plan once; its algorithm
    is the one cuSPARSELt's search picked for the first such product of its power-of-two bucket of token counts
    (searched outside CUDA-graph capture: a plan made during one keeps the defaults until the next product of its
    size outside a capture replaces it)."""
    lib = library()
    if lib is None:
        raise RuntimeError("cuSPARSELt is not available")
    if x.dtype not in DATA_TYPES:
        raise ValueError(f"cached cuSPARSELt plans take {', '.join(map(str, DATA_TYPES))} operands, not {x.dtype}")
    n, k = x.shape
    padded = -n % PAD_TOKENS
    if padded or not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
        x = torch.cat([x, x.new_zeros(padded, k)]) if padded else x.clone(memory_format=torch.contiguous_format)
    key = (x.device, x.dtype, rows, k, n + padded)
    plan = _plans.get(key)
    if plan is None or (plan.algorithm is None and not torch.cuda.is_current_stream_capturing()):
        with _lock:
            plan = _plan(lib, key, packed, x)
    out = plan.run(packed, x)
    return out[:n] if padded else out


def _plan(lib: _Library, key: tuple, packed: torch.Tensor, x: torch.Tensor) -> _Plan:
    device, dtype, rows, k, tokens = key
    bucket = (device, dtype, rows, k, min(1 << (tokens - 1).bit_length(), MAX_BUCKET))
    algorithm = _algorithms.get(bucket)
    if algorithm is None and not torch.cuda.is_current_stream_capturing():
        algorithm = _algorithms[bucket] = _Plan(lib, rows, k, tokens, dtype, device).search(packed, x)
    plan = _Plan(lib, rows, k, tokens, dtype, device, algorithm)
    if key not in _plans and len(_plans) >= MAX_PLANS:
        _plans.pop(next(iter(_plans)))
    _plans[key] = plan
    return plan
