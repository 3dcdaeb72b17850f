"""Host memory while loading a safetensors checkpoint onto 1 or 8 (fake CPU) devices.

    python benchmarks/load_memory.py [--hidden 1024 --layers 4 --vocab 16000] [--out FILE]

Writes a random f32 Llama checkpoint (numpy, no torch), then loads it in a fresh child
process per mesh (tensor=1 on one device, tensor=8 on 8 devices via
XLA_FLAGS=--xla_force_host_platform_device_count=8) through engine.loading.build_model.

What is measured, in the child, from /proc/self/status:
  * baseline: VmRSS after imports, mesh and runtime start, just before loading; then
    VmHWM is reset to it (echo 5 > /proc/self/clear_refs);
  * steady: VmRSS after loading (params on the devices, gc run);
  * peak: VmHWM after loading (the most RSS at any moment of the load);
  * transient = peak - steady: host memory the loader needed beyond the final params.
On CPU the "devices" live in host memory, so steady - baseline is the params themselves
(all 8 devices' shards in this one process); the loader's own cost is the transient.
RSS counts file pages while they are mapped, so a loader that keeps the checkpoint
mapped pays for every byte it touched.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from jaxfill.models.families.registry import config_from_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config(hidden: int, layers: int, vocab: int) -> dict:
    """A Llama config.json whose KV heads (8) split over tensor=8, so nothing large is replicated."""
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": hidden // 16, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False}


def write_checkpoint(directory: str, config: dict, seed: int = 0) -> dict:
    """Random f32 safetensors in HF layout, one tensor in memory at a time."""
    import numpy as np

    from jaxfill.models.checkpoint import hf_to_param

    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = {name: spec.hf_shape for name, spec in hf_to_param(config_from_hf(directory)).items()}
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for shape in shapes.values():
            f.write(rng.standard_normal(shape, dtype=np.float32).tobytes())
    return {"file_bytes": offset, "largest_tensor_bytes": max(int(np.prod(s)) * 4 for s in shapes.values()),
            "num_tensors": len(shapes)}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(model_dir: str, tensor: int, mesh_overrides: dict) -> dict:
    """Runs in the measured process: load, report the numbers above as JSON."""
    import jax
    import numpy as np

    import jaxfill
    from jaxfill.engine.config import load_config
    from jaxfill.engine.loading import build_mesh, build_model

    config = load_config("tiny_random", {"mesh.tensor": tensor, **mesh_overrides}, model_path=model_dir)
    mesh = build_mesh(config)
    jax.block_until_ready(jax.device_put(np.ones(8, np.float32), jax.devices()[0]))  # start the runtime
    gc.collect()
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    model = build_model(config, mesh, progress=False)
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    gc.collect()
    steady, peak = _status("VmRSS"), _status("VmHWM")
    local = sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards)
    return {"jaxfill": os.path.dirname(jaxfill.__file__), "tensor": tensor, "devices": len(jax.devices()),
            "process": jax.process_index(), "processes": jax.process_count(), "local_devices": len(jax.local_devices()), "baseline_rss": baseline, "steady_rss": steady,
            "peak_rss": peak, "transient": peak - steady, "params_rss": steady - baseline,
            "param_bytes": sum(x.nbytes for x in leaves), "local_shard_bytes": local}


def measure(model_dir: str, tensor: int, pythonpath: str | None = None, processes: int = 1) -> list[dict]:
    """One load in fresh processes (so each high-water mark is its own): `processes`
    processes of tensor/processes CPU devices each, joined by jax.distributed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={tensor // processes}",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p))
    procs = []
    for pid in range(processes):
        mesh = {} if processes == 1 else {"mesh.coordinator": f"127.0.0.1:{port}",
                                          "mesh.num_processes": processes, "mesh.process_id": pid}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", model_dir,
                                       str(tensor), json.dumps(mesh)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--processes", type=int, default=1, help="also load tensor=8 as N processes x 8/N devices")
    ap.add_argument("--pythonpath", help="a folder holding another `jaxfill` to measure (e.g. an older commit)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_memory.json"))
    args = ap.parse_args()
    config = hf_config(args.hidden, args.layers, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(tmp, config)
        runs = [r for t in (1, 8) for r in measure(tmp, t, args.pythonpath)]
        if args.processes > 1:
            runs += measure(tmp, 8, args.pythonpath, processes=args.processes)
    mb = 2 ** 20
    for r in runs:
        print(f"[{args.label}] tensor={r['tensor']} process {r.get('process', 0)}/{r.get('processes', 1)}: params {r['params_rss'] / mb:.0f} MiB, transient "
              f"{r['transient'] / mb:.1f} MiB (file {ckpt['file_bytes'] / mb:.0f} MiB, largest tensor "
              f"{ckpt['largest_tensor_bytes'] / mb:.1f} MiB)")
    result = {"label": args.label, "checkpoint": ckpt, "config": config, "runs": runs}
    existing = json.load(open(args.out)) if os.path.exists(args.out) else []
    existing = [e for e in existing if e.get("label") != args.label] + [result]
    with open(args.out, "w") as f:
        json.dump(existing, f, indent=1)


if __name__ == "__main__":
    main()
