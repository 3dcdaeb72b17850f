"""Tiny PEFT LoRA adapters written by `peft` itself on random-init transformers checkpoints,
and the transformers + PEFT reference they are compared with (tests/test_lora*.py).

PEFT inits lora_B to zeros (a fresh adapter is the base model): here A and B are drawn
at random, so an adapter the engine skipped, or scaled wrongly, changes the tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers + PEFT reference needs torch (the test extra)")
peft = pytest.importorskip("peft", reason="the LoRA reference needs peft (the test extra)")

from hf_models import load_hf, make_hf_checkpoint  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A: every projection, alpha / r; B: rslora (alpha / sqrt(r)) on a subset, a larger rank;
# C: the rest of the projections, rank 2
ADAPTERS = {
    "A": dict(r=4, lora_alpha=8, target_modules=ALL),
    "B": dict(r=8, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "C": dict(r=2, lora_alpha=4, target_modules=["k_proj", "gate_proj", "up_proj"]),
    # a MoE model's fused experts (PEFT target_parameters) beside attention and the dense layer's MLP
    "E": dict(r=4, lora_alpha=8, target_modules=ALL,
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "F": dict(r=8, lora_alpha=6, use_rslora=True, target_modules=["v_proj"],
              target_parameters=["mlp.experts.down_proj"]),
}


def write_adapter(base_dir: str, out_dir: str, seed: int, **lora_kwargs) -> str:
    """A PEFT adapter of the checkpoint at base_dir with random A and B, saved to out_dir."""
    model = peft.get_peft_model(load_hf(base_dir), peft.LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def make_family(root: str, arch: str, adapters=("A", "B")) -> tuple[str, dict[str, str]]:
    """(checkpoint dir, name -> adapter dir) under root."""
    base = make_hf_checkpoint(os.path.join(root, arch), arch)
    dirs = {name: write_adapter(base, os.path.join(root, f"{arch}-{name}"), seed=i + 1, **ADAPTERS[name])
            for i, name in enumerate(adapters)}
    return base, dirs


class Reference:
    """transformers + PEFT in f32: greedy tokens and the last prompt row's log-softmax."""

    def __init__(self, base_dir: str, adapters: dict[str, str]):
        self.base_dir, self.adapters, self.models = base_dir, adapters, {}

    def model(self, name: str | None):
        if name not in self.models:
            base = load_hf(self.base_dir)
            self.models[name] = base if name is None else peft.PeftModel.from_pretrained(base, self.adapters[name]).eval()
        return self.models[name]

    def greedy(self, name: str | None, ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = self.model(name).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return out[0, len(ids):].tolist()

    def last_logprobs(self, name: str | None, ids: list[int]) -> np.ndarray:  # [V] f64
        with torch.no_grad():
            logits = self.model(name)(torch.tensor([ids])).logits[0, -1].double()
        return torch.log_softmax(logits, -1).numpy()
