"""Images in prompts for Gemma 4 through the Engine against transformers'
Gemma4ForConditionalGeneration (random init, f32): greedy tokens and every step's top-20
logprobs. With use_bidirectional_attention="vision" (image rows attend each other both ways
on the sliding layer, causally on the full one): one image prefilled whole, two images of
different aspect ratios with the first chunk cut before the second image, the same image
again (encoder cache hit, no encoder run; the same prompt again: a prefix hit ending inside the
image, none shared with another image); a step budget under one image's rows refused at
load. With image rows causal (the same weights, the flag off): 32-row chunks that end
inside images give transformers' unchunked output. The "E" shape (per-layer inputs, where an
image row reads the pad token's id): one image."""

from __future__ import annotations

import numpy as np
import pytest

from vision_gemma4 import BOI, EOI, IMAGE, causal_copy, hf_gemma4_vl, tiny_gemma4_vl, torch
from vision_models import N_NEW, TOP, assert_matches

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import InvalidRequest, SamplingParams
from jaxfill.engine.vision.gemma4_tower import patch_xy
from jaxfill.engine.vision.loading import build_vision, images_refused

GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
RNG = np.random.default_rng(1)
WIDE = RNG.integers(0, 256, (12, 20, 3), np.uint8)  # 24 x 40 pixels: 6 x 10 soft tokens
SQUARE = RNG.integers(0, 256, (30, 33, 3), np.uint8)  # 28 x 32 pixels: 7 x 8 soft tokens
TALL = RNG.integers(0, 256, (40, 13, 3), np.uint8)


def one_image():  # 68 rows: the image is rows 4..63
    return [11, 12, 13, IMAGE, 21, 22, 23]


def two_images():  # 127 rows: the first image rows 3..62, the second 68..123
    return [31, 32, IMAGE, 41, 42, 43, IMAGE, 51, 52]


OVER = {"engine.max_model_len": 256, "engine.num_pages": 64, "engine.max_num_seqs": 4,
        "engine.enable_prefix_caching": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_gemma4_vl(str(tmp_path_factory.mktemp("gemma4_vl_engine")))


@pytest.fixture(scope="module")
def engine(ckpt):
    """96-row steps: one image prefills whole; two_images' first chunk is cut at row 68."""
    over = dict(OVER, **{"engine.max_num_batched_tokens": 96, "engine.token_buckets": [32, 64, 96],
                         "engine.enable_prefix_caching": True})
    return Engine(load_config("tiny_random", over, ckpt), progress=False)


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_gemma4_vl(ckpt)


def hf_generate(hf, engine, ids, images):
    """(tokens, per step log_softmax [V], prompt rows) of transformers' greedy generate."""
    vision = engine.runner.vision
    expanded, info = vision.expand(ids, images)
    px = np.stack([s.pixels for s in info.spans])
    xy = np.stack([patch_xy(s.grid[1], s.grid[2], vision.settings.max_patches) for s in info.spans])
    inp = torch.tensor([expanded])
    with torch.no_grad():
        g = hf.generate(input_ids=inp, pixel_values=torch.from_numpy(px), image_position_ids=torch.from_numpy(xy),
                        mm_token_type_ids=(inp == IMAGE).long(), max_new_tokens=N_NEW, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    lps = [torch.log_softmax(x[0].double(), -1).numpy() for x in g.logits]
    return g.sequences[0, len(expanded):].tolist(), lps, len(expanded)


def test_one_image_equals_transformers(engine, hf):
    ref = hf_generate(hf, engine, one_image(), [WIDE])
    expanded, info = engine.runner.vision.expand(one_image(), [WIDE])
    assert expanded[3] == BOI and expanded[64] == EOI and info.spans[0].length == 60 and info.whole
    out = engine.generate({"prompt": one_image(), "images": [WIDE]}, GREEDY)[0]
    assert out.prompt_tokens == ref[2] == 68
    assert_matches(out, ref)


def test_two_images_cut_before_an_image_equal_transformers(engine, hf):
    ref = hf_generate(hf, engine, two_images(), [WIDE, SQUARE])
    assert ref[2] == 127
    _, info = engine.runner.vision.expand(two_images(), [WIDE, SQUARE])
    assert info.cut(0, 96) == 68  # the scheduler's first chunk ends before the second image
    out = engine.generate({"prompt": two_images(), "images": [WIDE, SQUARE]}, GREEDY)[0]
    assert_matches(out, ref)


def test_same_image_again_hits_the_encoder_cache(engine, hf):
    first = engine.generate({"prompt": one_image(), "images": [TALL]}, GREEDY)[0]
    before = engine.stats()
    again = engine.generate({"prompt": [5, 6] + one_image(), "images": [TALL]}, GREEDY)[0]
    after = engine.stats()
    assert after["encoder_cache_misses"] == before["encoder_cache_misses"]
    assert after["encoder_cache_hits"] > before["encoder_cache_hits"]
    assert_matches(first, hf_generate(hf, engine, one_image(), [TALL]))
    assert_matches(again, hf_generate(hf, engine, [5, 6] + one_image(), [TALL]))
    cached = engine.generate({"prompt": one_image(), "images": [TALL]}, GREEDY)[0]
    assert 4 < cached.cached_tokens < 64  # the hit ends inside the image (rows 4..63): the rest see it whole
    assert_matches(cached, hf_generate(hf, engine, one_image(), [TALL]))
    other = RNG.integers(0, 256, TALL.shape, np.uint8)
    assert engine.generate({"prompt": one_image(), "images": [other]}, GREEDY)[0].cached_tokens == 0


def test_refusals(engine, ckpt):
    with pytest.raises(InvalidRequest, match="placeholders"):
        engine.generate({"prompt": [1, 2, 3], "images": [WIDE]}, GREEDY)
    # the capability table's images=bidirectional rules: the engine serves text, a request with images is refused
    pooled = load_config("tiny_random", {"model.pooling": "last"}, ckpt)
    assert "Gemma 4's" in images_refused(pooled) and images_refused(engine.config) is None
    engine.runner.vision.refused = images_refused(pooled)
    try:
        with pytest.raises(InvalidRequest, match="model.pooling"):
            engine.generate({"prompt": one_image(), "images": [WIDE]}, GREEDY)
    finally:
        engine.runner.vision.refused = None


def test_a_step_budget_under_one_image_is_refused(ckpt, tmp_path_factory):
    small = {"engine.max_num_batched_tokens": 32, "engine.token_buckets": [32]}
    with pytest.raises(ValueError, match="one Gemma 4 image"):
        build_vision(load_config("tiny_random", small, ckpt))
    causal = causal_copy(ckpt, str(tmp_path_factory.mktemp("gemma4_vl_causal_budget")))
    assert not build_vision(load_config("tiny_random", small, causal)).bidirectional  # causal rows may be split


def test_causal_image_rows_split_over_chunks_equal_transformers(ckpt, tmp_path_factory):
    causal = causal_copy(ckpt, str(tmp_path_factory.mktemp("gemma4_vl_causal")))
    over = dict(OVER, **{"engine.max_num_batched_tokens": 32, "engine.token_buckets": [16, 32]})
    eng = Engine(load_config("tiny_random", over, causal), progress=False)
    _, info = eng.runner.vision.expand(two_images(), [WIDE, SQUARE])
    assert not info.whole and info.cut(0, 32) == 32  # chunks end inside both images
    hf = hf_gemma4_vl(causal)
    for ids, images in ((one_image(), [WIDE]), (two_images(), [WIDE, SQUARE])):
        assert_matches(eng.generate({"prompt": ids, "images": images}, GREEDY)[0], hf_generate(hf, eng, ids, images))


def test_per_layer_inputs_read_the_pad_id_on_image_rows(tmp_path_factory):
    e_dir = tiny_gemma4_vl(str(tmp_path_factory.mktemp("gemma4_vl_e")), hidden_size_per_layer_input=8,
                           vocab_size_per_layer_input=512, pad_token_id=7)
    over = dict(OVER, **{"engine.max_num_batched_tokens": 96, "engine.token_buckets": [32, 64, 96]})
    eng = Engine(load_config("tiny_random", over, e_dir), progress=False)
    assert eng.runner.vision.pad_id == 7 and eng.runner.config.model.per_layer_input_size == 8
    ref = hf_generate(hf_gemma4_vl(e_dir), eng, one_image(), [WIDE])
    assert_matches(eng.generate({"prompt": one_image(), "images": [WIDE]}, GREEDY)[0], ref)
