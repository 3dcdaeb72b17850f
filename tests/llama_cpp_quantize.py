"""llama.cpp's own quantizer (`llama_model_quantize`, what the `llama-quantize` tool runs),
called through ctypes on the libllama of npm's `@node-llama-cpp/linux-x64` (3.22.1: llama.cpp
built for CPU; `npm pack @node-llama-cpp/linux-x64@3.22.1` and untar it). It writes the
k-quant mixes users download (Q4_K_M: Q6_K for some layers' attn_v / ffn_down and the
output, Q4_K elsewhere; Q5_0 / Q8_0 fallbacks for rows that are not whole 256-value
super-blocks). Not needed by the suite: tests/gguf_llama_cpp/ holds the files it made.

    python tests/llama_cpp_quantize.py LIB_DIR            # rewrites tests/gguf_llama_cpp/*.gguf
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

# llama_ftype values (llama.h)
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18}
HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "gguf_llama_cpp")
# name -> (arch, ftype, write_gguf keywords): tiny models whose rows are whole super-blocks
TINY = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=512)
# (qwen2's hidden 320 is no whole super-block: llama.cpp falls back to Q5_0 / Q8_0 there, as
# it does for SmolLM2's 576 and Qwen2.5-0.5B's 896)
FILES = {"llama_Q4_K_M": ("llama", "Q4_K_M", dict(tied=False, sizes=TINY)),
         "qwen2_Q4_K_M": ("qwen2", "Q4_K_M", dict(tied=True, sizes={**TINY, "hidden": 320, "heads": 5, "kv_heads": 1})),
         "qwen3_Q5_K_M": ("qwen3", "Q5_K_M", dict(tied=True, sizes={**TINY, "heads": 2, "kv_heads": 1}))}


def quantize(lib_dir: str, source: str, out: str, ftype: str) -> None:
    """llama_model_quantize(source, out) with llama.cpp's defaults and `ftype`."""
    for dep in ("libggml-base.so", "libggml.v0.5.0.so"):
        ctypes.CDLL(os.path.join(lib_dir, dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(lib_dir, "libllama.v0.5.0.so"))

    class Params(ctypes.Structure):  # llama_model_quantize_params, over-allocated: ftype is its 2nd int32
        _fields_ = [("raw", ctypes.c_ubyte * 512)]

    lib.llama_model_quantize_default_params.restype = Params
    params = lib.llama_model_quantize_default_params()
    ctypes.c_int32.from_buffer(params, 4).value = FTYPES[ftype]
    lib.llama_backend_init()
    rc = lib.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if rc:
        raise RuntimeError(f"llama_model_quantize({source}, {ftype}) returned {rc}")


def write_fixtures(lib_dir: str) -> None:
    from gguf_files import write_gguf

    os.makedirs(FIXTURES, exist_ok=True)
    for name, (arch, ftype, kw) in FILES.items():
        with tempfile.TemporaryDirectory() as tmp:
            source = write_gguf(tmp, arch, seed=7, every="F32", **kw)
            quantize(lib_dir, source, os.path.join(FIXTURES, f"{name}.gguf"), ftype)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    write_fixtures(sys.argv[1])
