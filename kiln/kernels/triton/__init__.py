"""The GPU kernels (Triton, and Gluon where a kernel states its register layout), one module per theme. TritonOps
(kiln.kernels) is their one caller in the model; each has its pure-torch twin in kiln/kernels/reference.py.

launch (programmatic dependent launch), norms (RMSNorm, SiLU·up, FP8 activations), rope_cache (rotary + KV-cache
write), paged_attention (prompts, split-K merge), decode_attention (one-token steps in one kernel), partitions
(split-K choice), mma_decode_attention (8-bit caches on mma.sync), gemv (the CUDA-core decode GEMV), fp8_decode (FP8
products of few rows), int4_fragments and int4_mma (int4 on the tensor cores), weight_only (products of more rows),
quant_linear (layouts at load and which kernel computes each product), argmax, fused_moe, and tuning (the measured
choices, and TritonOptions).

Importing this package imports no Triton: kiln.kernels reads tuning.TritonOptions on every install.
"""
