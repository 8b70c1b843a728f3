"""ggml block formats on the CPU: geometry, dequantization, quantization, random blocks, quantized matvec."""

from strata.quant.activation import Act, activation_values, prepare_activation
from strata.quant.dequant import dequantize, dequantize_rows
from strata.quant.formats import ACT_TYPE, QType, block_size, row_bytes, type_size
from strata.quant.matvec import default_pool, matvec, matvec_parallel, matvec_prepared, split_rows
from strata.quant.quantize import QUANTIZABLE, quantize
from strata.quant.randblocks import random_blocks

__all__ = [
    "ACT_TYPE", "Act", "QType", "QUANTIZABLE", "activation_values", "block_size", "default_pool", "dequantize",
    "dequantize_rows", "matvec", "matvec_parallel", "matvec_prepared", "prepare_activation", "quantize",
    "random_blocks", "row_bytes", "split_rows", "type_size",
]
