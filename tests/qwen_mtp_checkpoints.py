"""Tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints with their multi-token-prediction
block (`mtp.*`), and its torch reference (transformers builds no MTP block: the test writes
its weights itself).

The reference follows the published structure (vLLM's qwen3_5_mtp / qwen3_next_mtp, read,
not copied): h is the target's hidden state after its final norm; `fc` reads
[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]; then transformers' own
decoder layer class as a full-attention layer (gated attention, q/k norms, partial rope; the
dense MLP, or the sparse MoE with its gated shared expert), `norm`, the target's LM head.
Every norm is the family's (1 + w) RMSNorm.
"""

from __future__ import annotations

import copy
import importlib
import os

import pytest

torch = pytest.importorskip("torch", reason="the torch reference needs torch (the test extra)")

from hf_models import load_hf, make_hf_checkpoint  # noqa: E402
from mtp_checkpoints import layer_tensors, randomise  # noqa: E402

LAYER_CLASSES = {"qwen3_5": ("qwen3_5", "Qwen3_5"), "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5Moe"),
                 "qwen3_next": ("qwen3_next", "Qwen3Next")}


class TorchQwenMTP(torch.nn.Module):
    def __init__(self, hf_model, kind: str):
        super().__init__()
        module, prefix = LAYER_CLASSES[kind]
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        cfg = copy.deepcopy(hf_model.config)
        cfg.layer_types = list(cfg.layer_types) + ["full_attention"]  # the MTP layer: number num_hidden_layers
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = getattr(mod, prefix + "RMSNorm")
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(e, eps), norm(e, eps), norm(e, eps)
        self.fc = torch.nn.Linear(2 * e, e, bias=False)
        self.layer = getattr(mod, prefix + "DecoderLayer")(cfg, cfg.num_hidden_layers)
        self.mrope = kind != "qwen3_next"  # Qwen3.5's rotary takes (t, h, w) rows: all the text position
        self.target = hf_model

    def hidden(self, tokens):  # [T] -> [T, E] the target's final-norm hidden states
        return self.target.model(torch.tensor(tokens)[None]).last_hidden_state[0]

    def forward(self, hidden, next_tokens, start: int = 0):  # [T, E], [T] -> ([T, E] z, [T, V] logits)
        t = hidden.shape[0]
        e = self.target.model.embed_tokens(torch.tensor(next_tokens))
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        pos = torch.arange(start, start + t)[None]
        cos_sin = self.target.model.rotary_emb(z, pos[None].expand(3, 1, t) if self.mrope else pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        z = self.layer(z, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]  # [T, E]
        return z, self.target.lm_head(self.norm(z))

    def tensors(self) -> dict:
        """The MTP block's tensors as a checkpoint names them (mtp.*)."""
        out = {f"mtp.{n}.weight": getattr(self, n).weight.detach().clone()
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm", "fc")}
        return {**out, **layer_tensors(self.layer, "mtp.layers.0.")}


def copy_the_input(mtp: TorchQwenMTP) -> None:
    """A block that guesses its input token again (as tests/mtp_checkpoints.py's for DeepSeek):
    fc keeps the embedding half, the layer adds nothing (output projections zeroed), the
    embedding's and the final norm's weights 0 ((1 + w) norms: unit). With a tied head the
    guess for x_{t+2} is x_{t+1}: right where the target repeats a token, wrong elsewhere."""
    e = mtp.fc.weight.shape[0]
    with torch.no_grad():
        mtp.fc.weight.copy_(torch.cat([torch.eye(e), torch.zeros(e, e)], dim=1))
        for name, p in mtp.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
        mtp.pre_fc_norm_embedding.weight.zero_()
        mtp.norm.weight.zero_()


def make_qwen_mtp_checkpoint(directory: str, arch: str = "qwen3_5", seed: int = 0, copying: bool = False,
                             **overrides):
    """A random-init `arch` checkpoint with mtp_num_hidden_layers = 1 and its MTP block in
    model.safetensors; `copying`: a tied head and a block that guesses its input token.
    Returns (dir, TorchQwenMTP)."""
    from safetensors.torch import load_file, save_file

    if copying:
        overrides["tie_word_embeddings"] = True
    make_hf_checkpoint(directory, arch, seed=seed, mtp_num_hidden_layers=1, **overrides)
    hf = load_hf(directory)
    mtp = TorchQwenMTP(hf, arch).eval()
    randomise(mtp, seed + 1)
    if copying:
        copy_the_input(mtp)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    tensors.update(mtp.tensors())
    save_file(tensors, path, metadata={"format": "pt"})
    return directory, mtp
