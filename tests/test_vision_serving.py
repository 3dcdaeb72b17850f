"""Images over gRPC (serving/images.py) on the tiny random Qwen3-VL (tests/vision_models.py):
vLLM's protocol (media_refs with a data: URL, what smg forwards for an OpenAI image_url part)
and jaxfill.v1 (GenerateRequest.images) give the Python API's greedy tokens and logprobs for
the same image and prompt (which tests/test_vision_engine.py holds equal to transformers);
video, audio, router-preprocessed pixels, undecodable bytes and a model without a vision
tower are refused by name with INVALID_ARGUMENT, before any page is taken."""

from __future__ import annotations

import base64
import io

import grpc
import numpy as np
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from vision_models import IMAGE_TOKEN, N_NEW, VISION_END, VISION_START, tiny_qwen3_vl

from jaxfill import Engine
from jaxfill.engine.config import load_config
from jaxfill.engine.request import SamplingParams
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2 as pb
from jaxfill.serving.proto.jaxfill.v1 import generation_pb2_grpc as pb_grpc
from jaxfill.serving.client import Client
from jaxfill.serving.server import ServerThread

Image = pytest.importorskip("PIL.Image", reason="images need Pillow (the vision extra)")

LOGPROBS = 5
RNG = np.random.default_rng(2)
BIG = RNG.integers(0, 256, (128, 128, 3), np.uint8)  # 64 tokens
WIDE = RNG.integers(0, 256, (48, 120, 3), np.uint8)  # 24 tokens
ONE = [11, 12, 13, 14, 15, VISION_START, IMAGE_TOKEN, VISION_END, 21, 22, 23, 24]
TWO = [31, 32, 33, VISION_START, IMAGE_TOKEN, VISION_END, 41, 42, VISION_START, IMAGE_TOKEN, VISION_END, 51, 52]


def png(a: np.ndarray) -> bytes:  # lossless: the server decodes exactly `a`
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def data_url(a: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png(a)).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, engine, the Python API's completions for ONE + BIG and TWO + BIG, WIDE)."""
    ckpt = tiny_qwen3_vl(str(tmp_path_factory.mktemp("qwen3_vl_serving")))
    over = {"engine.max_model_len": 512, "engine.num_pages": 64, "engine.max_num_seqs": 4,
            "engine.max_num_batched_tokens": 64, "engine.token_buckets": [16, 64],
            "engine.attention_impl": "reference", "engine.enable_prefix_caching": True}
    engine = Engine(load_config("tiny_random", over, ckpt), progress=False)
    sp = SamplingParams(max_tokens=N_NEW, ignore_eos=True, logprobs=LOGPROBS)
    ref = engine.generate([{"prompt": ONE, "images": [BIG]}, {"prompt": TWO, "images": [BIG, WIDE]}], sp)
    engine.scheduler.replicas[0].bm.reset_prefix_cache()  # the server computes its prompts afresh
    with ServerThread(engine, host="127.0.0.1", port=0, warmup=False) as st:
        yield st, engine, ref


def _vllm(ids, rid, **extra) -> vpb.GenerateRequest:
    sp = vpb.SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=LOGPROBS)
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=sp,
                               **extra)


def _refs(*items) -> vpb.MediaRefs:
    return vpb.MediaRefs(items=[vpb.MediaRef(modality=m, url=u) for m, u in items])


def _pages_all_back(ch) -> bool:
    info = pb_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return info.pages_free == info.pages_total and info.num_running == info.num_waiting == 0


def test_vllm_media_refs_equal_the_python_api(served):
    st, _engine, ref = served
    with grpc.insecure_channel(st.address) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        assert stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10).supports_vision
        info = stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
        assert (info.mm_processor, info.mm_media_ref_schemes) == ("inprocess", "data")
        out = list(stub.Generate(_vllm(ONE, "img-1", media_refs=_refs((cpb.IMAGE, data_url(BIG)))), timeout=120))
    c = out[-1].complete
    assert list(c.output_ids) == ref[0].token_ids
    assert c.prompt_tokens == ref[0].prompt_tokens == len(ONE) - 1 + 64
    ours = np.asarray(c.output_logprobs.token_logprobs)
    assert np.allclose(ours, [s["logprob"] for s in ref[0].logprobs], rtol=0, atol=1e-5)


def test_jaxfill_images_equal_the_python_api(served):
    st, _engine, ref = served
    with Client(st.address) as client:  # serving/client.py's `images`
        out = list(client.stream(TWO, timeout=120, images=[png(BIG), png(WIDE)], max_tokens=N_NEW, ignore_eos=True,
                                 logprobs=LOGPROBS))
    tokens = [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids]
    assert tokens == ref[1].token_ids and out[-1].complete.prompt_tokens == ref[1].prompt_tokens
    lps = [lp.logprob for r in out if r.HasField("chunk") for lp in r.chunk.logprobs]
    assert np.allclose(lps, [s["logprob"] for s in ref[1].logprobs], rtol=0, atol=1e-5)


def test_refusals_by_name_lose_nothing(served):
    st, _engine, ref = served
    junk = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    cases = [  # (request, the field the message starts with, a word it holds)
        (_vllm(ONE, "v", media_refs=_refs((cpb.VIDEO, data_url(BIG)))), "media_refs.items[0]", "video"),
        (_vllm(ONE, "a", media_refs=_refs((cpb.AUDIO, "data:audio/wav;base64,AAAA"))), "media_refs.items[0]", "audio"),
        (_vllm(ONE, "u", media_refs=_refs((cpb.IMAGE, junk))), "media_refs.items[0]", "undecodable"),
        (_vllm(ONE, "h", media_refs=_refs((cpb.IMAGE, "https://example.com/cat.png"))), "media_refs.items[0].url",
         "data:"),
        (_vllm(ONE, "m", mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"])), "mm_inputs", "media_refs"),
        (_vllm(ONE, "mv", mm_inputs=vpb.MultimodalInputs(modality=cpb.VIDEO)), "mm_inputs", "video"),
        (_vllm([1, 2, 3], "p", media_refs=_refs((cpb.IMAGE, data_url(BIG)))), "media_refs.items", "placeholders"),
    ]
    with grpc.insecure_channel(st.address) as ch:
        stub, jf = vpb_grpc.VllmEngineStub(ch), pb_grpc.GenerationStub(ch)
        for req, field, word in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
            assert e.value.details().startswith(field + ":") and word in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(jf.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ONE), images=[b"\x89PNG broken"]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("images[0]: undecodable"), e.value.details()
        assert st.call(lambda: st.server.loop.num_active) == 0
        assert _pages_all_back(ch)
        # still serving: the same request with its image gives the same tokens
        out = list(stub.Generate(_vllm(ONE, "after", media_refs=_refs((cpb.IMAGE, data_url(BIG)))), timeout=120))
        assert list(out[-1].complete.output_ids) == ref[0].token_ids


def test_image_for_a_model_without_a_vision_tower_is_refused():
    engine = Engine(load_config("tiny_random", {"engine.num_pages": 16, "engine.max_model_len": 128}),
                    progress=False, warmup=False)  # refused before any step: nothing compiles
    with ServerThread(engine, host="127.0.0.1", port=0, warmup=False) as st, grpc.insecure_channel(st.address) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        assert not stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10).supports_vision
        assert stub.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).mm_processor == ""
        for call in (lambda: list(stub.Generate(_vllm([1, 2, 3], "t", media_refs=_refs((cpb.IMAGE, data_url(BIG)))),
                                                timeout=30)),
                     lambda: list(pb_grpc.GenerationStub(ch).Generate(
                         pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), images=[png(BIG)]), timeout=30))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no vision tower" in e.value.details(), e.value.details()
