"""An OpenAI chat message with an `image_url` data URL through the real smg gateway to a
jaxfill worker serving the tiny random Qwen3-VL (tests/vision_models.py, with a byte-level
tokenizer and Qwen3-VL's special tokens): the gateway renders the chat template, sees that
the worker processes media itself (GetServerInfo's mm_processor) and forwards the image as
media_refs; the worker decodes and expands it (serving/images.py). The completion equals
Engine.generate on the same ids and image."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
from gateway_util import SmgProcess, smg_binary
from vision_models import add_tokenizer, tiny_qwen3_vl

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import SamplingParams
from jaxfill.serving.server import ServerThread

import openai  # the test extra installs it, and smg: missing is a failure, never a skip

Image = pytest.importorskip("PIL.Image", reason="images need Pillow (the vision extra)")
assert smg_binary(), "the smg gateway binary is not on PATH: pip install -e '.[test]'"

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny")
N_NEW = 6
# what CHAT_TEMPLATE renders for one user turn [image, "hi"] with the generation prompt
RENDERED = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"


def test_image_url_chat_through_smg_equals_engine_generate(tmp_path):
    ckpt = add_tokenizer(tiny_qwen3_vl(str(tmp_path)), TINY)
    over = {"engine.max_model_len": 512, "engine.num_pages": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
            "engine.attention_impl": "reference"}
    engine = Engine(load_config("tiny_random", over, ckpt), progress=False)
    image = np.random.default_rng(3).integers(0, 256, (128, 128, 3), np.uint8)
    ids = engine.tokenizer.encode(RENDERED, False)
    ref = engine.generate({"prompt": ids, "images": [image]}, SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    engine.scheduler.replicas[0].bm.reset_prefix_cache()
    from tokenizers import Tokenizer
    want = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json")).decode(ref.token_ids, skip_special_tokens=False)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with ServerThread(engine, host="127.0.0.1", port=0, warmup=False) as st:
        smg = SmgProcess([st.address])
        try:
            client = openai.OpenAI(base_url=smg.base_url, api_key="unused", max_retries=0)
            r = client.chat.completions.create(
                model=smg.model, max_tokens=N_NEW, temperature=0.0,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "hi"}]}],
                extra_body={"ignore_eos": True, "skip_special_tokens": False}, timeout=60)
        except BaseException:
            print(smg.log())
            raise
        finally:
            smg.kill()
    assert r.usage.prompt_tokens == ref.prompt_tokens == len(ids) - 1 + 64
    assert r.choices[0].message.content == want, (r.choices[0].message.content, want)
