"""Rope at million-token positions equals Hugging Face's.

Context parallelism serves prompts of 128k to 1M tokens, where rope scaling (llama3,
YaRN) decides everything and float32 position arithmetic is at its least forgiving.
transformers' own rope init (ROPE_INIT_FUNCTIONS) gives the inverse frequencies and
attention scale; its forward multiplies them by the positions in float32 and takes cos
and sin. Ours must give the same frequencies (llama3's bit for bit; YaRN's blend leaves
1e-11 on its slowest ones, 1e-5 rad at 2^20) and the same rotation at
positions up to 2^20 - 1 (the cos/sin of arguments near 1e6 radians are where a
mismatch in the f32 product would show first).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxfill.models.rope import apply_rope, rope_parameters  # noqa: E402

HEAD_DIM = 128
POSITIONS = np.array([0, 1, 8191, 131071, 131072, 524287, 1048575], np.int32)
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
             "rope_theta": 1000000.0},
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_at_a_million_positions_equals_hf(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[kind]
    hf_config = LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                            max_position_embeddings=1048576, rope_parameters=dict(scaling))
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    inv, scale = rope_parameters(HEAD_DIM, scaling["rope_theta"], scaling, 1048576)
    # A frequency off by d turns position p by p * d more: bound that at the last position.
    phase = float(np.abs(inv.astype(np.float64) - hf_inv.numpy().astype(np.float64)).max()) * POSITIONS[-1]
    assert phase < 1e-4, phase  # numpy's own float32 pow: 0.06 rad for llama3
    assert scale == pytest.approx(hf_scale, rel=1e-12)

    # HF's forward: f32 inv_freq x f32 positions, cat, cos/sin times the scale, rotate half
    freqs = hf_inv[:, None].float() @ torch.from_numpy(POSITIONS)[None, :].float()  # [D/2, P]
    emb = torch.cat([freqs.T, freqs.T], dim=-1)
    cos, sin = emb.cos() * hf_scale, emb.sin() * hf_scale
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((len(POSITIONS), 1, HEAD_DIM)).astype(np.float32))
    rotated = torch.cat([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], dim=-1)
    want = (x * cos[:, None] + rotated * sin[:, None]).numpy()
    got = np.asarray(apply_rope(x.numpy(), POSITIONS, inv, scale))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
