"""Qwen3.5 with images (Qwen3_5ForConditionalGeneration: Gated DeltaNet layers beside gated
attention roping a quarter of each head with (t, h, w) sections, and Qwen3-VL's vision tower
without DeepStack) through the Engine against transformers, random init, f32: greedy
tokens and every step's top-20 logprobs, the prompt's image rows split over two prefill
chunks (the recurrent state carried across the boundary inside the image)."""

from __future__ import annotations

import numpy as np
import pytest

from vision_models import (IMAGE_TOKEN, N_NEW, TOP, VISION_END, VISION_START, assert_matches, hf_generate,
                           hf_qwen3_5_vl, tiny_qwen3_5_vl)

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
RNG = np.random.default_rng(2)
BIG = RNG.integers(0, 256, (128, 128, 3), np.uint8)  # 64 tokens
WIDE = RNG.integers(0, 256, (40, 120, 3), np.uint8)  # 32 x 128 pixels: a 2 x 8 merged grid, 16 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3_5_vl(str(tmp_path_factory.mktemp("qwen3_5_vl")))


@pytest.fixture(scope="module")
def engine(ckpt):  # 64-token steps: both prompts below split inside BIG
    over = {"engine.max_model_len": 512, "engine.num_pages": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
            "engine.attention_impl": "reference"}
    return Engine(load_config("tiny_random", over, ckpt), progress=False)


def test_one_image_in_two_chunks_equals_transformers(engine, ckpt):
    ids = [11, 12, 13, 14, 15, VISION_START, IMAGE_TOKEN, VISION_END, 21, 22, 23, 24]
    ref = hf_generate(hf_qwen3_5_vl(ckpt), engine, ids, [BIG])
    assert ref[2] == 75
    assert_matches(engine.generate({"prompt": ids, "images": [BIG]}, GREEDY)[0], ref)


def test_two_images_equal_transformers(engine, ckpt):
    ids = [31, 32, 33, VISION_START, IMAGE_TOKEN, VISION_END, 41, 42, 43, VISION_START, IMAGE_TOKEN, VISION_END,
           51, 52]
    ref = hf_generate(hf_qwen3_5_vl(ckpt), engine, ids, [BIG, WIDE])
    assert_matches(engine.generate({"prompt": ids, "images": [BIG, WIDE]}, GREEDY)[0], ref)
