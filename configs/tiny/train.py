"""Trains the `tiny` preset's weights on configs/tiny/corpus/ and writes an HF checkpoint.

    python configs/tiny/train.py            # from the repository root; see configs/tiny/README.md

Plain JAX: a full-sequence causal forward written here for training (the engine's forward
is paged and computes logits only at sampled rows), over the SAME parameter pytree as
`jaxfill.models.decoder.Decoder`, with a hand-written AdamW. Byte-level: each sample is
BOS (256) followed by the UTF-8 bytes of the text from the start of a random line.
At the end the script proves what it wrote: the checkpoint loads through
`load_hf_params` into exactly the trained params, and the engine's paged forward gives
the training forward's logits on held-out text.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxfill.models.config import ModelConfig
from jaxfill.models.rope import apply_rope, rope_inv_freq
from jaxfill.models.decoder import Decoder

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = os.path.join(os.path.dirname(HERE), "tiny.toml")
BOS = 256
HELD_OUT_FRACTION = 0.05  # the last 5% of every play is never trained on


@dataclasses.dataclass(frozen=True)
class Hyper:
    steps: int = 2000
    batch: int = 16
    seq_len: int = 128  # tokens per sample, BOS included
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to peak_lr * this
    warmup: int = 50
    weight_decay: float = 0.1  # matrices only, not norms
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    seed: int = 0
    eval_every: int = 200


def tiny_model_config() -> ModelConfig:
    with open(PRESET, "rb") as f:
        return ModelConfig.from_dict(tomllib.load(f)["model"])


# ----------------------------------------------------------------------------- data

def load_corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train bytes, held-out bytes) as uint8 arrays; plays split at 95% of their length."""
    train, held = [], []
    files = sorted(glob.glob(os.path.join(HERE, "corpus", "*.txt")))
    if not files:
        raise SystemExit("no configs/tiny/corpus/*.txt: run configs/tiny/prepare_data.py first")
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        cut = data.rfind(b"\n", 0, int(len(data) * (1 - HELD_OUT_FRACTION))) + 1
        train.append(data[:cut])
        held.append(data[cut:])
    as_array = lambda parts: np.frombuffer(b"".join(parts), np.uint8)
    return as_array(train), as_array(held)


def line_starts(data: np.ndarray, seq_len: int) -> np.ndarray:
    """Offsets of lines with at least seq_len bytes after them (samples start at a line)."""
    starts = np.concatenate([[0], np.flatnonzero(data == ord("\n")) + 1])
    return starts[starts + seq_len <= len(data)]


def make_batch(data: np.ndarray,  # [N] uint8
               offsets: np.ndarray,  # [B] int
               seq_len: int) -> np.ndarray:  # [B, seq_len + 1] int32: BOS + seq_len bytes
    rows = data[offsets[:, None] + np.arange(seq_len)[None, :]].astype(np.int32)
    return np.concatenate([np.full((len(offsets), 1), BOS, np.int32), rows], axis=1)


# ----------------------------------------------------------------------------- model

def rms_norm(x, weight, eps):  # [..., E] -> [..., E], as models/layers.RMSNorm
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def train_forward(params: dict, tokens: jax.Array,  # [B, T] int32
                  config: ModelConfig) -> jax.Array:  # logits [B, T, V] float32
    """Full-sequence causal forward over Llama's pure-dict params (no KV cache)."""
    c = config
    inv_freq = jnp.asarray(rope_inv_freq(c.head_dim, c.attention.rope_theta, c.attention.rope_scaling_dict))
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    causal = positions[:, None] >= positions[None, :]  # [T, T]
    group = c.num_heads // c.num_kv_heads
    x = params["embed"]["embedding"][tokens]  # [B, T, E]
    for n in range(c.num_layers):
        p = params["layers"][n]
        h = rms_norm(x, p["attn_norm"]["weight"], c.norms.eps)
        q = apply_rope(jnp.einsum("bte,ehd->bthd", h, p["attn"]["q"]), positions, inv_freq)
        k = apply_rope(jnp.einsum("bte,ehd->bthd", h, p["attn"]["k"]), positions, inv_freq)
        v = jnp.einsum("bte,ehd->bthd", h, p["attn"]["v"])
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # query head i -> kv head i // group
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * c.head_dim ** -0.5
        scores = jnp.where(causal, scores, -1e30)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("bthd,hde->bte", attn, p["attn"]["o"])
        h = rms_norm(x, p["mlp_norm"]["weight"], c.norms.eps)
        x = x + (jax.nn.silu(h @ p["mlp"]["gate"]) * (h @ p["mlp"]["up"])) @ p["mlp"]["down"]
    x = rms_norm(x, params["norm"]["weight"], c.norms.eps)
    return (x @ params["lm_head"]).astype(jnp.float32)


def loss_fn(params, batch, config):  # batch [B, T + 1] -> mean next-byte cross-entropy (nats)
    logits = train_forward(params, batch[:, :-1], config)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


# ----------------------------------------------------------------------------- AdamW

def learning_rate(step, h: Hyper):
    """Linear warm-up, then cosine decay to min_lr_ratio * peak."""
    warm = h.peak_lr * (step + 1) / h.warmup
    progress = jnp.clip((step - h.warmup) / max(h.steps - h.warmup, 1), 0.0, 1.0)
    cosine = h.peak_lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(step < h.warmup, warm, cosine)


def make_train_step(config: ModelConfig, h: Hyper):
    @jax.jit
    def step_fn(params, m, v, step, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, config)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, h.clip_norm / (norm + 1e-6)), grads)
        m = jax.tree_util.tree_map(lambda m, g: h.beta1 * m + (1 - h.beta1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: h.beta2 * v + (1 - h.beta2) * g * g, v, grads)
        t = step + 1
        lr = learning_rate(step, h)

        def update(p, m, v):
            m_hat, v_hat = m / (1 - h.beta1 ** t), v / (1 - h.beta2 ** t)
            decay = h.weight_decay * p if p.ndim >= 2 else 0.0
            return p - lr * (m_hat / (jnp.sqrt(v_hat) + h.eps) + decay)

        params = jax.tree_util.tree_map(update, params, m, v)
        return params, m, v, loss, norm

    return step_fn


def evaluate(params, config, data: np.ndarray, seq_len: int, num: int = 64) -> float:
    """Mean loss (nats/byte) over `num` fixed windows spread evenly through `data`."""
    starts = line_starts(data, seq_len)
    picks = starts[np.linspace(0, len(starts) - 1, num).astype(int)]
    loss = jax.jit(loss_fn, static_argnums=2)
    return float(np.mean([loss(params, make_batch(data, picks[i:i + 16], seq_len), config)
                          for i in range(0, num, 16)]))


# ----------------------------------------------------------------------------- export + checks

def hf_tensors(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Llama pure-dict params -> HF LlamaForCausalLM tensor names/layouts (inverse of checkpoint.hf_to_param)."""
    c = config
    e = c.hidden_size
    out = {"model.embed_tokens.weight": params["embed"]["embedding"],
           "model.norm.weight": params["norm"]["weight"],
           "lm_head.weight": params["lm_head"].T}
    for n in range(c.num_layers):
        p, pre = params["layers"][n], f"model.layers.{n}."
        out.update({
            pre + "self_attn.q_proj.weight": p["attn"]["q"].reshape(e, -1).T,
            pre + "self_attn.k_proj.weight": p["attn"]["k"].reshape(e, -1).T,
            pre + "self_attn.v_proj.weight": p["attn"]["v"].reshape(e, -1).T,
            pre + "self_attn.o_proj.weight": p["attn"]["o"].reshape(-1, e).T,
            pre + "mlp.gate_proj.weight": p["mlp"]["gate"].T,
            pre + "mlp.up_proj.weight": p["mlp"]["up"].T,
            pre + "mlp.down_proj.weight": p["mlp"]["down"].T,
            pre + "input_layernorm.weight": p["attn_norm"]["weight"],
            pre + "post_attention_layernorm.weight": p["mlp_norm"]["weight"],
        })
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}


def hf_config(config: ModelConfig) -> dict:
    c = config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norms.eps,
        "rope_theta": c.attention.rope_theta, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": 257,
        "torch_dtype": "float32", "initializer_range": 0.02,
    }


def save_checkpoint(params: dict, config: ModelConfig, directory: str, metadata: dict) -> None:
    from safetensors.numpy import save_file

    save_file(hf_tensors(params, config), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt", **{k: str(v) for k, v in metadata.items()}})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=2)
        f.write("\n")


def paged_logits(model: Decoder, tokens: np.ndarray) -> np.ndarray:  # [T] -> [T, V]
    """The engine's paged forward over one sequence, logits at every row; unused pages NaN."""
    from jaxfill.models.forward import forward
    from jaxfill.models.kv_cache import KVCache, single_sequence_metadata

    page_size, n = 16, len(tokens)
    pages = list(range(1, -(-n // page_size) + 1))
    cache = KVCache.create(model.config, len(pages) + 4, page_size, fill_value=float("nan"))
    meta = single_sequence_metadata(n, 0, pages, page_size)
    meta = dataclasses.replace(meta, logits_indices=jnp.arange(n, dtype=jnp.int32))
    graphdef, state = nnx.split(model)
    logits, _ = forward(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.arange(n, dtype=jnp.int32), cache, meta)
    return np.asarray(logits)


def verify_checkpoint(params: dict, config: ModelConfig, directory: str, held: np.ndarray) -> float:
    """Loads what was written the way the engine does; returns max |paged - training| logit gap."""
    from jaxfill.models.checkpoint import load_hf_params

    loaded = load_hf_params(directory, config, progress=False)
    loaded_params = nnx.to_pure_dict(nnx.split(loaded)[1])
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves_with_path(loaded_params), strict=True):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(f"checkpoint round trip changed {jax.tree_util.keystr(path)}")
    tokens = make_batch(held, line_starts(held, 200)[:1], 200)[0]
    ours = np.asarray(jax.jit(train_forward, static_argnums=2)(params, tokens[None], config))[0]
    gap = float(np.max(np.abs(paged_logits(loaded, tokens) - ours)))
    if not gap < 1e-4:
        raise AssertionError(f"paged forward differs from the training forward by {gap}")
    return gap


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(Hyper):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    parser.add_argument("--out", default=HERE, help="checkpoint directory (default: configs/tiny/)")
    args = parser.parse_args()
    h = Hyper(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Hyper)})
    config = tiny_model_config()
    train, held = load_corpus()
    starts = line_starts(train, h.seq_len)
    print(f"train {len(train)} bytes, held-out {len(held)} bytes; {h}")

    params = nnx.to_pure_dict(nnx.split(Decoder(config, nnx.Rngs(h.seed)))[1])
    zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, params)
    m, v = zeros(), zeros()
    step_fn = make_train_step(config, h)
    rng = np.random.default_rng(h.seed)
    start = time.perf_counter()
    history = []
    bar = tqdm(range(h.steps), desc="training", unit="step")
    for step in bar:
        batch = make_batch(train, rng.choice(starts, h.batch), h.seq_len)
        params, m, v, loss, norm = step_fn(params, m, v, jnp.int32(step), batch)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}", gnorm=f"{float(norm):.2f}")
        if (step + 1) % h.eval_every == 0 or step + 1 == h.steps:
            held_loss = evaluate(params, config, held, h.seq_len)
            history.append({"step": step + 1, "train_loss": float(loss), "held_out_loss": held_loss})
            tqdm.write(f"step {step + 1}: train {float(loss):.4f}  held-out {held_loss:.4f} nats/byte "
                       f"({held_loss / math.log(2):.3f} bits/byte)")
    minutes = (time.perf_counter() - start) / 60
    train_loss = evaluate(params, config, train, h.seq_len)
    held_loss = evaluate(params, config, held, h.seq_len)
    result = {
        "hyperparameters": dataclasses.asdict(h), "train_minutes": round(minutes, 1),
        "train_loss_nats": round(train_loss, 4), "held_out_loss_nats": round(held_loss, 4),
        "train_bits_per_byte": round(train_loss / math.log(2), 4),
        "held_out_bits_per_byte": round(held_loss / math.log(2), 4), "history": history,
    }
    os.makedirs(args.out, exist_ok=True)
    save_checkpoint(params, config, args.out, {k: v for k, v in result.items() if k.endswith(("nats", "byte"))})
    result["paged_vs_training_max_logit_gap"] = verify_checkpoint(params, config, args.out, held)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=2))


if __name__ == "__main__":
    main()
