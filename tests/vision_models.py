"""A random-init tiny Qwen3VLForConditionalGeneration (2 text layers, a 3-block vision tower
with DeepStack after blocks 0 and 1, so the second add lands on the last layer's pruned rows)
and its image processor's preprocessor_config.json (patch 8, merge 2, at most 128 x 128
pixels), written with save_pretrained."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxfill.engine.vision.image_processor import image_batch
from jaxfill.engine.vision.prompt import expand

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
N_NEW, TOP = 6, 20  # tokens generated, logprobs compared per step
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
            initializer_range=0.4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [4, 2, 2], "mrope_interleaved": True})
# patch 8, merge 2: a 448 x 448 image is a 56 x 56 patch grid, 784 tokens after merging
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=64,
              deepstack_visual_indexes=[0, 1], initializer_range=0.2)


def tiny_qwen3_vl(directory: str) -> str:
    """Write the checkpoint into `directory` (if not there yet); returns it."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False)
    return _save(Qwen3VLForConditionalGeneration(config).eval(), directory)


def _save(model, directory: str) -> str:
    """The model, its biases and norms moved away from their 0 / 1 init (so a dropped one
    shows), and the image processor config the engine reads beside it."""
    from transformers import Qwen2VLImageProcessorPil
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                             ).save_pretrained(directory)
    return directory


def hf_model(directory: str):
    from transformers import Qwen3VLForConditionalGeneration
    return Qwen3VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


def config_json(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


# Qwen3.5: three Gated DeltaNet layers then a gated full-attention layer roping a quarter of
# its 32-wide heads (4 frequencies: t, h, w, t), the vision tower without DeepStack
TEXT_3_5 = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                initializer_range=0.4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=24, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})


def tiny_qwen3_5_vl(directory: str) -> str:
    """A random-init Qwen3_5ForConditionalGeneration and its image processor config."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    vision = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    config = Qwen3_5Config(text_config=TEXT_3_5, vision_config=vision, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=False)
    return _save(Qwen3_5ForConditionalGeneration(config).eval(), directory)


def hf_qwen3_5_vl(directory: str):
    from transformers import Qwen3_5ForConditionalGeneration
    return Qwen3_5ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


# the MoE classes: 4 experts of 24 (2 x 24 != hidden 64: the two expert layouts differ in
# shape), top 2. Qwen3-VL-MoE: three layers, the middle one dense (mlp_only_layers), DeepStack
# after layers 0 and 1; Qwen3.5-MoE: every layer sparse beside a gated shared expert
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


def tiny_qwen3_vl_moe(directory: str) -> str:
    """A random-init Qwen3VLMoeForConditionalGeneration and its image processor config."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(0)
    config = Qwen3VLMoeConfig(text_config=dict(TEXT, num_hidden_layers=3, mlp_only_layers=[1], **MOE),
                              vision_config=VISION, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                              tie_word_embeddings=False)
    return _save(Qwen3VLMoeForConditionalGeneration(config).eval(), directory)


def tiny_qwen3_5_moe_vl(directory: str) -> str:
    """A random-init Qwen3_5MoeForConditionalGeneration and its image processor config."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(0)
    vision = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}
    config = Qwen3_5MoeConfig(text_config=dict(TEXT_3_5, shared_expert_intermediate_size=32, **MOE),
                              vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                              tie_word_embeddings=False)
    return _save(Qwen3_5MoeForConditionalGeneration(config).eval(), directory)


def hf_of(directory: str):
    """transformers' model of the checkpoint's class (config.json `architectures`), f32."""
    import transformers
    cls = getattr(transformers, config_json(directory)["architectures"][0])
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def hf_generate(hf, engine, ids, images):
    """(tokens, per step log_softmax [V]) of transformers' greedy generate."""
    s = engine.runner.vision.settings
    expanded, _ = expand(ids, images, s, IMAGE_TOKEN)
    pixels, grids = image_batch(images, s)
    inp = torch.tensor([expanded])
    with torch.no_grad():
        g = hf.generate(input_ids=inp, pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.tensor(grids),
                        mm_token_type_ids=(inp == IMAGE_TOKEN).int(), max_new_tokens=N_NEW, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    lps = [torch.log_softmax(x[0].double(), -1).numpy() for x in g.logits]
    return g.sequences[0, len(expanded):].tolist(), lps, len(expanded)


def rel_l2(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def assert_matches(completion, ref, bound: float = 1e-5):
    """Greedy tokens equal, and each step's top-20 (ids as ours, values as HF's at those ids,
    and HF's own top 20) within 1e-5 relative L2: the parity tests' measure (test_family_parity.py)."""
    tokens, lps, _ = ref
    assert completion.token_ids == tokens
    for step, ref_lp in zip(completion.logprobs, lps):
        ids = [i for i, _ in step["top"]]
        ours = [v for _, v in step["top"]]
        assert rel_l2(ours, ref_lp[ids]) <= bound, (ours, ref_lp[ids])
        assert rel_l2(ours, np.sort(ref_lp)[::-1][:TOP]) <= bound  # they are HF's top 20


CHAT_TEMPLATE = (  # Qwen3-VL's layout of a chat, trimmed: each image part is one placeholder between its markers
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tokenizer(directory: str, tiny_dir: str) -> str:
    """configs/tiny's byte-level tokenizer (`tiny_dir`) with Qwen3-VL's chat and vision special
    tokens at the checkpoint's ids (498 .. 503; reserved ids fill the gap), no BOS, and the
    chat template above: what the smg gateway needs to tokenize an image chat for it."""
    with open(os.path.join(tiny_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    added = [t for t in tok["added_tokens"] if t["id"] < 320]
    names = {498: "<|im_start|>", 499: "<|im_end|>", IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>",
             VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>"}
    for i in range(320, 504):
        added.append(dict(added[-1], id=i, content=names.get(i, f"<reserved_{i}>")))
    tok["added_tokens"], tok["post_processor"] = added, None
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "add_bos_token": False,
                   "chat_template": CHAT_TEMPLATE, "model_max_length": 4096}, f)
    return directory
