"""Lowest layer of jaxfill: the paged KV layout and ragged paged attention kernels.

Imports nothing from the rest of the project.
"""

from jaxfill.pallas_kernels.kv_cache import init_kv_pages, merge_kv, split_kv, write_kv
from jaxfill.pallas_kernels.kv_quant import QUANT_DTYPES, QuantizedPages, init_quantized_pages
from jaxfill.pallas_kernels.ragged_paged_attention import IMPLS, ragged_paged_attention, resolve_impl

__all__ = ["init_kv_pages", "write_kv", "merge_kv", "split_kv", "ragged_paged_attention",
           "resolve_impl", "IMPLS", "QuantizedPages", "init_quantized_pages", "QUANT_DTYPES"]
