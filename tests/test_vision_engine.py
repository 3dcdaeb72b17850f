"""Images in prompts through the Engine against transformers' Qwen3VLForConditionalGeneration
(random init, f32): greedy tokens and every step's top-20 logprobs for one image and for two
images of different sizes; a chunk boundary inside an image; the prefix cache with the same
image (a hit, the encoder not run again) and with another image (no page of the image span
shared). The multimodal rope, the image rows, DeepStack and the rope delta of decode all
show in the logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from vision_models import (IMAGE_TOKEN, N_NEW, TOP, VISION_END, VISION_START, assert_matches, hf_generate,
                           hf_model, tiny_qwen3_vl, torch)

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
RNG = np.random.default_rng(1)
BIG = RNG.integers(0, 256, (128, 128, 3), np.uint8)  # 16 x 16 patches: 64 tokens
WIDE = RNG.integers(0, 256, (48, 120, 3), np.uint8)  # to 48 x 128: 6 x 16 patches (encoded padded to 128), 24 tokens
OTHER = RNG.integers(0, 256, (128, 128, 3), np.uint8)  # BIG's size, other pixels


def one_image():  # the image starts at row 6, inside the first 16-token page
    return [11, 12, 13, 14, 15, VISION_START, IMAGE_TOKEN, VISION_END, 21, 22, 23, 24]


def text_then_image():  # 18 text rows: the first page is text only, the image starts on the second
    return list(range(60, 78)) + [VISION_START, IMAGE_TOKEN, VISION_END, 21, 22, 23]


def two_images():
    return [31, 32, 33, VISION_START, IMAGE_TOKEN, VISION_END, 41, 42, 43, 44, 45, 46, VISION_START,
            IMAGE_TOKEN, VISION_END, 51, 52, 53, 54]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_engine")))


def _engine(ckpt, budget: int, buckets: list[int], async_scheduling: bool = True) -> Engine:
    over = {"engine.max_model_len": 512, "engine.num_pages": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": budget, "engine.token_buckets": buckets,
            "engine.async_scheduling": async_scheduling,
            "engine.attention_impl": "reference", "engine.enable_prefix_caching": True}
    return Engine(load_config("tiny_random", over, ckpt), progress=False)


@pytest.fixture(scope="module")
def chunked(ckpt):  # 64-token steps: the 105-row two-image prompt splits at row 64, inside BIG
    return _engine(ckpt, 64, [16, 64])


@pytest.fixture(scope="module")
def whole(ckpt):  # and synchronous: the chunked engine schedules asynchronously (the default)
    return _engine(ckpt, 128, [16, 128], async_scheduling=False)


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


def test_one_image_equals_transformers(chunked, hf):
    ref = hf_generate(hf, chunked, one_image(), [BIG])
    out = chunked.generate({"prompt": one_image(), "images": [BIG]}, GREEDY)[0]
    assert out.prompt_tokens == ref[2] == len(one_image()) - 1 + 64
    assert_matches(out, ref)


def test_two_images_chunked_and_whole_equal_transformers(chunked, whole, hf):
    """105 prompt rows: in 64-token steps a chunk ends at row 64, inside the first image."""
    ref = hf_generate(hf, chunked, two_images(), [BIG, WIDE])
    assert ref[2] == 105  # BIG holds rows 4..67
    misses = chunked.stats()["encoder_cache_misses"]
    assert_matches(chunked.generate({"prompt": two_images(), "images": [BIG, WIDE]}, GREEDY)[0], ref)
    assert_matches(whole.generate({"prompt": two_images(), "images": [BIG, WIDE]}, GREEDY)[0], ref)
    new = chunked.stats()["encoder_cache_misses"] - misses
    assert new <= 2  # each image encoded once at most, though BIG's rows came in two chunks


def test_text_only_prompt_is_plain_rope(whole, hf):
    ids = [5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        g = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)
    assert whole.generate([ids], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0].token_ids == \
        g[0, len(ids):].tolist()


def test_prefix_cache_shares_an_image_only_with_itself(ckpt, hf):
    """The same prompt and image again: its full pages are cached hits and the encoder's
    output too; another image after the same text: the text-only first page is shared, no
    page holding image rows is, and the output is that image's."""
    engine = _engine(ckpt, 64, [16, 64])
    prompt = text_then_image()
    first = engine.generate({"prompt": prompt, "images": [BIG]}, GREEDY)[0]
    before = engine.stats()
    again = engine.generate({"prompt": prompt, "images": [BIG]}, GREEDY)[0]
    after = engine.stats()
    assert again.cached_tokens == 80 and again.token_ids == first.token_ids  # 5 full pages of 87 rows
    assert_matches(again, hf_generate(hf, engine, prompt, [BIG]))
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]
    assert after["encoder_cache_hits"] > before["encoder_cache_hits"]
    other = engine.generate({"prompt": prompt, "images": [OTHER]}, GREEDY)[0]
    assert other.cached_tokens == 16  # the text page; the image's rows start at row 19
    assert engine.stats()["encoder_cache_misses"] == after["encoder_cache_misses"] + 1
    assert_matches(other, hf_generate(hf, engine, prompt, [OTHER]))
    assert [s["top"] for s in other.logprobs] != [s["top"] for s in first.logprobs]
    # a request named as the sibling of one with the same ids but another image shares nothing of it
    a = engine.add_request({"prompt": prompt, "images": [BIG]}, GREEDY)
    b = engine.add_request({"prompt": prompt, "images": [OTHER]}, GREEDY, after=a)
    done = {}
    while len(done) < 2:
        done.update({o.request_id: o.completion for o in engine.step() if o.finished})
    assert done[a].token_ids == first.token_ids and done[b].token_ids == other.token_ids


def test_refusals(whole):
    with pytest.raises(InvalidRequest, match="placeholders"):
        whole.generate({"prompt": [1, 2, 3], "images": [BIG]}, GREEDY)
    with pytest.raises(InvalidRequest, match="video"):
        whole.generate({"prompt": one_image(), "videos": [BIG]}, GREEDY)
    with pytest.raises(InvalidRequest, match="uint8"):
        whole.generate({"prompt": one_image(), "images": [BIG.astype(np.float32)]}, GREEDY)
    text_only = Engine(load_config("tiny_random", {"engine.num_pages": 16, "engine.max_model_len": 128}),
                       progress=False, warmup=False)  # refused before any step: nothing compiles
    with pytest.raises(InvalidRequest, match="no vision tower"):
        text_only.generate({"prompt": [1, 2, 3], "images": [BIG]}, GREEDY)
