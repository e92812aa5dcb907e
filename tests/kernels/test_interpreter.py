"""The Triton kernels' interpreter cases (marker `interpreter`: Triton's interpreter runs the GPU kernels on the CPU,
checked against the same references as on the GPU), each group in a fresh process with TRITON_INTERPRET=1, which
must be set before Triton is first imported; in this process they skip."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import INTERPRETING

HERE = Path(__file__).parent


def _interpreted(*files: str) -> None:
    """The interpreter cases of `files` (of this directory) in a fresh process."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already interpreted")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "interpreter",
                           *(str(HERE / f) for f in files)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_weight_only_products():
    _interpreted("test_weight_only_gemm.py")


@pytest.mark.slow
def test_quantized_layers_attention_norms_and_argmax():
    _interpreted("test_quant_linear.py", "test_int4_mma.py", "test_attention.py", "test_norms.py", "test_argmax.py")


@pytest.mark.slow
def test_fused_moe():
    _interpreted("test_fused_moe.py")


def test_lora_products():
    _interpreted("test_lora_kernels.py")
