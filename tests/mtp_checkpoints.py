"""Tiny DeepSeek-V3 / GLM-4.5 checkpoints with a multi-token-prediction layer, and its torch
reference (transformers builds no MTP layer: the test writes its weights itself).

The reference is built from transformers' own decoder layer class at layer number
num_hidden_layers (DeepseekV3DecoderLayer: MLA + the routed MoE), with enorm, hnorm,
eh_proj and shared_head.norm around it, as the DeepSeek-V3 paper and vLLM's deepseek_mtp
(read, not copied) wire them: h is the target's hidden state after its final norm, and
eh_proj reads [embedding, hidden].
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch reference needs torch (the test extra)")

from hf_models import load_hf, make_hf_checkpoint  # noqa: E402

LAYER_CLASSES = {"deepseek_v3": ("deepseek_v3", "DeepseekV3"), "glm4_moe": ("glm4_moe", "Glm4Moe")}


class TorchMTP(torch.nn.Module):
    def __init__(self, hf_model, kind: str):
        import importlib

        super().__init__()
        module, prefix = LAYER_CLASSES[kind]
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        cfg = hf_model.config
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = getattr(mod, prefix + "RMSNorm")
        self.enorm, self.hnorm, self.norm = norm(e, eps), norm(e, eps), norm(e, eps)
        self.eh_proj = torch.nn.Linear(2 * e, e, bias=False)
        self.layer = getattr(mod, prefix + "DecoderLayer")(cfg, cfg.num_hidden_layers)
        self.target = hf_model

    def hidden(self, tokens):  # [T] -> [T, E] the target's final-norm hidden states
        return self.target.model(torch.tensor(tokens)[None]).last_hidden_state[0]

    def forward(self, hidden, next_tokens, start: int = 0):  # [T, E], [T] -> ([T, E] z, [T, V] logits)
        """Rows at positions start..start+T-1 attending to each other causally (the whole
        sequence when start = 0)."""
        t = hidden.shape[0]
        e = self.target.model.embed_tokens(torch.tensor(next_tokens))
        z = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))[None]
        pos = torch.arange(start, start + t)[None]
        cos_sin = self.target.model.rotary_emb(z, pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        z = self.layer(z, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]
        return z, self.target.lm_head(self.norm(z))

    def tensors(self, num_layers: int) -> dict:
        """The MTP layer's tensors as a checkpoint names them (model.layers.{L}.*)."""
        p = f"model.layers.{num_layers}."
        out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
               p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.norm.weight}
        return {**{k: v.detach().clone().contiguous() for k, v in out.items()}, **layer_tensors(self.layer, p)}


def layer_tensors(layer, p: str) -> dict:
    """A torch decoder layer's tensors named under prefix `p`, experts one by one."""
    out = {}
    for k, v in layer.state_dict().items():
        if k.endswith("experts.gate_up_proj"):  # fused [X, 2I, E] -> per expert, as save_pretrained writes
            for x, gate_up in enumerate(v):
                gate, up = gate_up.chunk(2, dim=0)
                out[p + k.replace("gate_up_proj", f"{x}.gate_proj.weight")] = gate
                out[p + k.replace("gate_up_proj", f"{x}.up_proj.weight")] = up
        elif k.endswith("experts.down_proj"):
            for x, down in enumerate(v):
                out[p + k.replace("down_proj", f"{x}.down_proj.weight")] = down
        else:
            out[p + k] = v
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def randomise(module, seed: int) -> None:
    """Norms far from 1, the router's correction bias far from 0 (as hf_models does)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("target."):
                continue
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("correction_bias") and not name.startswith("target."):
                b.add_(0.3 * torch.randn(b.shape, generator=g))


def copy_the_input(mtp: TorchMTP) -> None:
    """An MTP layer that guesses its input token again: eh_proj keeps the embedding half, the
    decoder layer adds nothing (its output projections zeroed), unit norms. With the head
    tied to the embedding, the guess for x_{t+2} is x_{t+1}: right whenever the target
    repeats itself, which random tiny targets soon do."""
    e = mtp.eh_proj.weight.shape[0]
    with torch.no_grad():
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(e), torch.zeros(e, e)], dim=1))
        for name, p in mtp.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
        mtp.enorm.weight.fill_(1.0)
        mtp.norm.weight.fill_(1.0)


def make_mtp_checkpoint(directory: str, arch: str = "deepseek_v3", copies: bool = True, seed: int = 0,
                        copying: bool = False, **overrides):
    """A random-init checkpoint of `arch` with num_nextn_predict_layers = 1 and the MTP
    layer's tensors written into model.safetensors; `copies`: with the MTP layer's copies of
    the embedding and the head too (DeepSeek-V3's files have them); `copying`: a tied head and
    an MTP layer that guesses its input token (copy_the_input). Returns (dir, TorchMTP)."""
    from safetensors.torch import load_file, save_file

    if copying:
        overrides["tie_word_embeddings"] = True
    make_hf_checkpoint(directory, arch, seed=seed, num_nextn_predict_layers=1, **overrides)
    hf = load_hf(directory)
    mtp = TorchMTP(hf, arch).eval()
    randomise(mtp, seed + 1)
    if copying:
        copy_the_input(mtp)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    layers = hf.config.num_hidden_layers
    tensors.update(mtp.tensors(layers))
    if copies:
        p = f"model.layers.{layers}."
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[p + "shared_head.head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return directory, mtp


def reference(mtp: TorchMTP, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(target hidden [T, E], MTP logits [T - 1, V]) over the sequence: row t from h_t and x_{t+1}."""
    with torch.no_grad():
        h = mtp.hidden(tokens)
        _, logits = mtp(h[:-1], list(tokens[1:]))
    return h.double().numpy(), logits.double().numpy()
