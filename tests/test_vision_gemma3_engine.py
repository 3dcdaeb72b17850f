"""Images in prompts for Gemma 3 through the Engine against transformers'
Gemma3ForConditionalGeneration (random init, f32): greedy tokens and every step's top-20
logprobs for one image and for two images of different sizes, whole and in chunks the
scheduler cuts before the second image (its rows attend each other both ways, so an image
is never split); the same image again (cached pages, a prefix hit ending inside the image,
no new encoder run) and another image (no page holding image rows shared)."""

from __future__ import annotations

import numpy as np
import pytest

from vision_gemma3 import BOI, IMAGE, MM_TOKENS, hf_gemma3_vl, hf_processor, tiny_gemma3_vl, torch
from vision_models import N_NEW, TOP, assert_matches

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest, SamplingParams
from jaxfill.engine.vision.gemma3_images import pixels
from jaxfill.engine.vision.loading import build_vision, images_refused

GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
RNG = np.random.default_rng(1)
SQUARE = RNG.integers(0, 256, (32, 32, 3), np.uint8)
WIDE = RNG.integers(0, 256, (20, 57, 3), np.uint8)  # resized to 32 x 32
OTHER = RNG.integers(0, 256, (32, 32, 3), np.uint8)


def one_image():
    return [11, 12, 13, BOI, 21, 22, 23]


def two_images():  # 43 rows: the second image is rows 24..39
    return [31, 32, BOI, 41, 42, 43, BOI, 51, 52]


def text_then_image():  # 39 rows: page 0 text only, the image rows 19..34
    return list(range(60, 78)) + [BOI, 21, 22, 23]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma3_vl(str(tmp_path_factory.mktemp("gemma3_vl_engine")))


@pytest.fixture(scope="module")
def engine(ckpt):
    """32-token steps: the one-image prompt runs whole; the two-image prompt's first chunk is
    cut at row 24, before the second image, and text_then_image's at row 19."""
    over = {"engine.max_model_len": 256, "engine.num_pages": 48, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 32, "engine.token_buckets": [16, 32],
            "engine.enable_prefix_caching": True}
    return Engine(load_config("tiny_random", over, ckpt), progress=False)


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_gemma3_vl(ckpt)


def hf_generate(hf, engine, ids, images):
    """(tokens, per step log_softmax [V], prompt rows) of transformers' greedy generate."""
    expanded, _ = engine.runner.vision.expand(ids, images)
    px = np.stack([pixels(im, engine.runner.vision.settings) for im in images])
    inp = torch.tensor([expanded])
    with torch.no_grad():
        g = hf.generate(input_ids=inp, pixel_values=torch.from_numpy(px), token_type_ids=(inp == IMAGE).long(),
                        max_new_tokens=N_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    lps = [torch.log_softmax(x[0].double(), -1).numpy() for x in g.logits]
    return g.sequences[0, len(expanded):].tolist(), lps, len(expanded)


def test_one_image_equals_transformers(engine, hf):
    ref = hf_generate(hf, engine, one_image(), [SQUARE])
    out = engine.generate({"prompt": one_image(), "images": [SQUARE]}, GREEDY)[0]
    assert out.prompt_tokens == ref[2] == len(one_image()) + MM_TOKENS + 1
    assert_matches(out, ref)


def test_two_images_cut_before_an_image_equal_transformers(engine, hf):
    ref = hf_generate(hf, engine, two_images(), [SQUARE, WIDE])
    assert ref[2] == 43
    out = engine.generate({"prompt": two_images(), "images": [SQUARE, WIDE]}, GREEDY)[0]
    assert_matches(out, ref)


def test_text_only_prompt_equals_transformers(engine, hf):
    ids = [2, 5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        g = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)
    assert engine.generate([ids], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0].token_ids == \
        g[0, len(ids):].tolist()


def test_prefix_cache_shares_an_image_only_with_itself(engine, hf):
    eng, prompt = engine, text_then_image()
    first = eng.generate({"prompt": prompt, "images": [SQUARE]}, GREEDY)[0]
    before = eng.stats()
    again = eng.generate({"prompt": prompt, "images": [SQUARE]}, GREEDY)[0]
    after = eng.stats()
    assert again.cached_tokens == 32 and again.token_ids == first.token_ids  # the hit ends at row 32, in the image
    assert_matches(again, hf_generate(hf, eng, prompt, [SQUARE]))
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]
    assert after["encoder_cache_hits"] > before["encoder_cache_hits"]
    other = eng.generate({"prompt": prompt, "images": [OTHER]}, GREEDY)[0]
    assert other.cached_tokens == 16  # the text page only
    assert eng.stats()["encoder_cache_misses"] == after["encoder_cache_misses"] + 1
    assert_matches(other, hf_generate(hf, eng, prompt, [OTHER]))


def test_text_prompt_expands_as_the_processor(engine, ckpt):
    """A text prompt's `<start_of_image>`: the ids and pixels Gemma3Processor makes (its
    two newlines around each image block included)."""
    text = "user\n<start_of_image>What is this?<start_of_image>\nAnd this?\n"
    ref = hf_processor(ckpt)(text=text, images=[SQUARE, WIDE], return_tensors="np")
    ours, _ = engine.factory.check({"prompt": text, "images": [SQUARE, WIDE]}, GREEDY)
    assert list(ours) == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.stack([s.pixels for s in ours.images.spans]), ref["pixel_values"])


def test_refusals(engine, ckpt):
    with pytest.raises(InvalidRequest, match="placeholders"):
        engine.generate({"prompt": [1, 2, 3], "images": [SQUARE]}, GREEDY)
    with pytest.raises(InvalidRequest, match="expanded prompt"):
        engine.generate({"prompt": one_image() + [IMAGE], "images": [SQUARE]}, GREEDY)
    # the capability table's images=bidirectional rules: the engine serves text, a request with images is refused
    host = load_config("tiny_random", {"engine.host_kv_cache_gb": 1}, ckpt)
    assert "Gemma 3 images" in images_refused(host) and images_refused(engine.config) is None
    engine.runner.vision.refused = images_refused(host)
    try:
        with pytest.raises(InvalidRequest, match="host_kv_cache_gb"):
            engine.generate({"prompt": one_image(), "images": [SQUARE]}, GREEDY)
    finally:
        engine.runner.vision.refused = None
    # an image is prefilled in one chunk: a step budget under its 16 rows could never schedule it
    small = load_config("tiny_random", {"engine.max_num_batched_tokens": 8, "engine.token_buckets": [8]}, ckpt)
    with pytest.raises(ValueError, match="one Gemma 3 image"):
        build_vision(small)
