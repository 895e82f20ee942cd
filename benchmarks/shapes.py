"""The shapes the benchmark measures: Llama-3-8B's MLP and attention projections."""

from __future__ import annotations

HIDDEN, FFN, QKV = 4096, 14336, 6144
LORA_RANK = 16

# block kind -> the (in_features, out_features) of its linears, in order
BLOCKS = {
    "mlp": [(HIDDEN, FFN), (FFN, HIDDEN)],  # up, GELU, down
    "attn": [(HIDDEN, QKV), (HIDDEN, HIDDEN)],  # qkv projection, output projection
}

MAIN_TOKENS = (8192, 2048)
MAIN_BLOCKS = 2
TOKEN_SWEEP = (2048, 4096, 8192, 16384)
DEPTH_SWEEP = (2, 4, 8, 16)

H200_DENSE_FP8_TFLOPS = 1979.0
