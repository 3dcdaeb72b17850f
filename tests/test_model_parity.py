"""Logits and greedy tokens equal Hugging Face transformers on random-init checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

from jaxfill.engine.simple import generate_one, prefill_chunks
from hf_models import load_hf
from jaxfill.models import KVCache
from jaxfill.models.mixers import attention
from jaxfill.models.checkpoint import load_hf_params
from jaxfill.models.families.registry import config_from_hf

PAGE = 16


def ours_last_logits(model, config, tokens):
    """Every prompt in steps of STEP_ROWS rows over one cache shape: one compiled program
    per model (the whole-prompt path and chunked == whole are tested elsewhere)."""
    logits, _ = prefill_chunks(model, list(tokens), parity_cache(config), PARITY_PAGES, step_rows=STEP_ROWS)
    return np.asarray(logits, np.float64)


# bf16 is judged against the float64 truth, not against HF's bf16: two bf16 runs that each
# sit ~0.015 (relative L2 of the last logits) from the truth can differ by 0.02+ from each
# other, and which way each rounding falls depends on the CPU's kernels. The reference is HF
# in float64 on the same bf16-rounded weights; our bf16 must be no further from it than
# 1.25x HF's own bf16. Measured (3 archs x lengths 1/7/64/300): ours 0.006..0.014, HF
# 0.0065..0.016, ratio 0.78..1.07. A wrong cast order fails it by far
# (test_bf16_tolerance_rejects_rope_angles_in_bf16); single rounding sites are pinned per
# kernel in test_attention_oracle.py.
BF16_RATIO = 1.25
BF16_PROMPT_RATIO = 1.5  # one prompt alone (check_bf16_at_the_noise_floor)
PROMPT_LENGTHS = (1, 7, 64, 300)
# The parity checks run every prompt, and the greedy continuation's every step, as steps
# padded to 64 rows over one cache shape: one XLA compile per model instead of one per
# prompt length (the family parity files took 22 of CI's worker-minutes, mostly compiling).
STEP_ROWS = 64
PARITY_PAGES = list(range(1, max(PROMPT_LENGTHS) // PAGE + 2))


def parity_cache(config):
    return KVCache.create(config, num_pages=len(PARITY_PAGES) + 1, page_size=PAGE, fill_value=float("nan"))


def prompts(vocab_size):
    """(length, tokens) for each of PROMPT_LENGTHS, from one fixed seed."""
    rng = np.random.default_rng(1)
    return [(n, rng.integers(0, vocab_size, n)) for n in PROMPT_LENGTHS]


def hf_last_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(tokens)[None]).logits[0, -1].double().numpy()


def rel_l2(ours, ref):
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def hf_bf16_and_truth(hf_dir):
    """HF in bf16, and HF in float64 on the same bf16-rounded weights (the truth bf16 aims at)."""
    return load_hf(hf_dir, torch.bfloat16), load_hf(hf_dir, torch.bfloat16).to(torch.float64)


def check_bf16_at_the_noise_floor(hf_dir):
    """Our bf16 no further from the float64 truth than HF's own bf16, over the prompts of
    7, 64 and 300 tokens: summed, within BF16_RATIO of HF's sum; each prompt within
    BF16_PROMPT_RATIO. One prompt's error is one draw of which way the roundings fall, and
    that depends on the CPU's kernels: on an avx512_bf16 host (2026-12-03) Qwen3's
    64-token prompt measured 1.37x HF (the others 0.90x and 1.05x), where the previous
    host passed 1.25x on each. A wrong cast order is 9x..20x (the negative control)."""
    config = dataclasses.replace(config_from_hf(hf_dir), dtype="bfloat16")
    model = load_hf_params(hf_dir, config, progress=False)
    hf, truth = hf_bf16_and_truth(hf_dir)
    ours_all, theirs_all = [], []
    for length, tokens in prompts(config.vocab_size)[1:]:
        want = hf_last_logits(truth, tokens)
        ours = rel_l2(ours_last_logits(model, config, tokens), want)
        theirs = rel_l2(hf_last_logits(hf, tokens), want)
        assert ours <= BF16_PROMPT_RATIO * theirs, (hf_dir, length, ours, theirs)
        ours_all.append(ours)
        theirs_all.append(theirs)
    assert sum(ours_all) <= BF16_RATIO * sum(theirs_all), (hf_dir, ours_all, theirs_all)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_logits_match_hf(hf_dirs, arch, dtype):
    config = dataclasses.replace(config_from_hf(hf_dirs[arch]), dtype=dtype)
    if arch == "mistral":
        assert config.attention.sliding_window == 24  # shorter than the 64- and 300-token prompts
    if arch == "qwen2":
        assert config.attention.bias and config.embeddings.tied
    if arch == "llama":
        assert dict(config.attention.rope_scaling)["rope_type"] == "llama3" and config.num_kv_heads < config.num_heads
    model = load_hf_params(hf_dirs[arch], config, progress=False)
    if dtype == "float32":
        hf = load_hf(hf_dirs[arch])
        for length, tokens in prompts(config.vocab_size):
            err = rel_l2(ours_last_logits(model, config, tokens), hf_last_logits(hf, tokens))
            assert err <= 1e-5, (arch, length, err)
        return
    hf, truth = hf_bf16_and_truth(hf_dirs[arch])
    for length, tokens in prompts(config.vocab_size):
        want = hf_last_logits(truth, tokens)
        ours = rel_l2(ours_last_logits(model, config, tokens), want)
        theirs = rel_l2(hf_last_logits(hf, tokens), want)
        assert ours <= BF16_RATIO * theirs, (arch, length, ours, theirs)


def rope_angles_in_bf16(x,  # [T, H, D]
                        positions,  # [T] int32
                        inv_freq,  # [D/2]
                        scale=1.0,  # yarn cos/sin scale (1 for the archs it runs on)
                        interleaved=False, in_f32=False):  # apply_rope's (off for these archs)
    """A wrong cast order: angles from positions and frequencies rounded to x's dtype
    (bf16 holds integers exactly only up to 256), where HF and we compute them in f32."""
    assert not (interleaved or in_f32)
    freqs = positions.astype(x.dtype)[:, None] * jnp.asarray(inv_freq).astype(x.dtype)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(emb)[:, None, :] + rotated * jnp.sin(emb)[:, None, :]


@pytest.mark.xla_attention  # bf16 rounding as the CPU default impl casts
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_bf16_tolerance_rejects_rope_angles_in_bf16(hf_dirs, arch, monkeypatch):
    """Negative control: BF16_RATIO is tight enough that a wrong cast order in RoPE fails it
    by > 3x on the 300-token prompt (measured 9x..20x HF's own bf16 error)."""
    config = dataclasses.replace(config_from_hf(hf_dirs[arch]), dtype="bfloat16")
    hf, truth = hf_bf16_and_truth(hf_dirs[arch])
    length, tokens = prompts(config.vocab_size)[-1]
    want = hf_last_logits(truth, tokens)
    # The forward jit is keyed by the model's graphdef, which a patched function does not
    # change: clear the trace cache on the way in and out so no other test sees this trace.
    monkeypatch.setattr(attention, "apply_rope", rope_angles_in_bf16)
    jax.clear_caches()
    try:
        model = load_hf_params(hf_dirs[arch], config, progress=False)
        ours = rel_l2(ours_last_logits(model, config, tokens), want)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    theirs = rel_l2(hf_last_logits(hf, tokens), want)
    assert ours > 3 * BF16_RATIO * theirs, (arch, length, ours, theirs)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_continuation_matches_hf_generate(hf_dirs, arch):
    config = config_from_hf(hf_dirs[arch])
    model = load_hf_params(hf_dirs[arch], config, progress=False)
    check_greedy_matches_hf(model, config, load_hf(hf_dirs[arch]), 32)


def check_greedy_matches_hf(model, config, hf, new_tokens: int) -> None:
    """Our greedy continuation of a 20-token prompt is HF generate's, token for token."""
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 20)
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt)[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    ours, _ = generate_one(model, list(prompt), parity_cache(config), new_tokens, pages=PARITY_PAGES,
                           step_rows=STEP_ROWS)
    assert ours == expected
    assert len(set(expected)) > 1  # a continuation stuck on one token would prove little


def test_sliding_window_changes_logits(hf_dirs):
    """The window really applies: removing it changes logits of a prompt longer than it."""
    config = config_from_hf(hf_dirs["mistral"])
    windowed = load_hf_params(hf_dirs["mistral"], config, progress=False)
    full = load_hf_params(hf_dirs["mistral"], config.replace(sliding_window=None), progress=False)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 64)
    a, b = ours_last_logits(windowed, config, tokens), ours_last_logits(full, config, tokens)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) > 1e-3
