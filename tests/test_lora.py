"""Multi-LoRA per request (engine/lora/, models/lora.py) against transformers + PEFT in f32:
base rows and the rows of two adapters in one batch, chunked and prefix-cached; KV never
shared across adapters; slots evicted and reloaded; no step compiled by a load; bad input
refused by name with nothing lost."""

import numpy as np
import pytest

from lora_adapters import ADAPTERS, Reference, make_family, write_adapter
from fast_engine import REFERENCE_ATTENTION
from jaxfill.engine.engine import Engine
from jaxfill.engine.lora.adapter import AdapterError
from jaxfill.engine.request import InvalidRequest, SamplingParams

LORA = {"lora.max_loras": 2, "lora.max_lora_rank": 8, "lora.max_cpu_loras": 2}
ENGINE = {**REFERENCE_ATTENTION, "engine.max_num_batched_tokens": 64, "engine.num_pages": 64,
          "engine.max_model_len": 256, "engine.max_num_seqs": 4, "engine.kv_fill_value": float("nan")}
TOKENS = 6


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


class Family:
    def __init__(self, root, arch, adapters):
        self.base, self.dirs = make_family(str(root), arch, adapters)
        self.ref = Reference(self.base, self.dirs)
        self.engine = Engine.from_config(model_path=self.base, overrides={**ENGINE, **LORA}, progress=False)
        for name in adapters:
            self.engine.load_lora(name, self.dirs[name])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("lora"), "llama", ("A", "B", "C"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return Family(tmp_path_factory.mktemp("lora"), "qwen3", ("A", "B"))


def check_tokens(fam, ids, name, completion):
    assert completion.token_ids == fam.ref.greedy(name, ids, TOKENS), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_equals_transformers_peft(arch, request):
    """One generate: a 100-token prompt (chunked over the 64-token budget) under A, base
    rows, B, A again; greedy tokens and the first token's top-5 logprobs equal the
    reference's; then the long prompt again under A, from the prefix cache."""
    fam = request.getfixturevalue(arch)
    long, short, mid = prompt(100, 1), prompt(7, 2), prompt(30, 3)
    asks = [(long, "A"), (short, None), (mid, "B"), (short, "A")]
    outs = fam.engine.generate([ids for ids, _ in asks],
                               [SamplingParams(max_tokens=TOKENS, lora=name, logprobs=5) for _, name in asks])
    for (ids, name), out in zip(asks, outs):
        check_tokens(fam, ids, name, out)
        ref = fam.ref.last_logprobs(name, ids)
        top = out.logprobs[0]["top"]
        np.testing.assert_allclose([lp for _, lp in top], ref[[i for i, _ in top]], atol=2e-4, rtol=1e-4)
        assert [i for i, _ in top] == np.argsort(-ref)[:5].tolist()
    assert outs[1].token_ids != outs[3].token_ids  # the adapter changes the short prompt's tokens
    again = fam.engine.generate([long], SamplingParams(max_tokens=TOKENS, lora="A"))[0]
    assert again.cached_tokens >= 96
    check_tokens(fam, long, "A", again)


def test_kv_is_never_shared_across_adapters(llama):
    """A prompt computed under A is recomputed under B and under the base model (no prefix
    hit), each giving the reference's tokens; under A again it hits."""
    ids = prompt(50, 4)
    runs = [(name, llama.engine.generate([ids], SamplingParams(max_tokens=TOKENS, lora=name))[0])
            for name in ("A", "B", None, "A")]
    assert [out.cached_tokens for _, out in runs] == [0, 0, 0, 48]
    for name, out in runs:
        check_tokens(llama, ids, name, out)


def test_evicted_and_reloaded_adapters_give_the_same_tokens(llama):
    """Three adapters over two device slots and two host copies: each use past the
    capacity evicts the least recently used slot (and host copy, re-read from disk), and
    tokens stay the reference's; three adapters in one generate wait for a free slot."""
    ids = prompt(20, 5)
    before = llama.engine.stats()
    for name in ("C", "A", "B", "C", "A"):
        check_tokens(llama, ids, name, llama.engine.generate([ids], SamplingParams(max_tokens=TOKENS, lora=name))[0])
    after = llama.engine.stats()
    assert after["lora_slot_writes"] - before["lora_slot_writes"] >= 4
    assert after["lora_reads"] > before["lora_reads"]  # a host copy dropped and read again
    names = ["A", "B", "C", None]
    outs = llama.engine.generate([ids] * 4, [SamplingParams(max_tokens=TOKENS, lora=n) for n in names])
    for name, out in zip(names, outs):
        check_tokens(llama, ids, name, out)
    twins = llama.engine.generate([ids], SamplingParams(max_tokens=TOKENS, lora="C", n=2))  # samples share the slot
    for out in twins:
        check_tokens(llama, ids, "C", out)
    assert llama.engine.stats()["compiled_programs"] == before["compiled_programs"]  # slot writes compile no step


def test_bad_requests_are_refused_by_name_and_lose_nothing(llama, tmp_path):
    eng = llama.engine
    free = eng.stats()["pages_free"]
    with pytest.raises(InvalidRequest, match="lora: unknown adapter 'nope'"):
        eng.add_request(prompt(20, 6), SamplingParams(lora="nope"))
    with pytest.raises(InvalidRequest, match="lora: must be an adapter name"):
        eng.add_request(prompt(20, 6), SamplingParams(lora=3))
    with pytest.raises(InvalidRequest, match="already loaded"):
        eng.load_lora("A", llama.dirs["A"])
    assert eng.unload_lora("nope") is False
    rid = eng.add_request(prompt(20, 6), SamplingParams(lora="B"))
    with pytest.raises(InvalidRequest, match="in use"):
        eng.unload_lora("B")
    eng.abort(rid)
    eng.step()
    assert not eng.has_unfinished() and eng.stats()["pages_free"] == free
    bad = {"dora": (dict(use_dora=True), "use_dora"), "bias": (dict(bias="all"), "bias"),
           "save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
           "embed": (dict(target_modules=["embed_tokens"]), "embedding / lm_head"),
           "rank": (dict(r=16), "over lora.max_lora_rank")}
    for name, (kw, match) in bad.items():
        cfg = {**ADAPTERS["A"], **kw}
        path = write_adapter(llama.base, str(tmp_path / name), seed=9, **cfg)
        with pytest.raises(AdapterError, match=match):
            eng.load_lora(name, path)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        eng.load_lora("missing", str(tmp_path / "missing"))
    assert [a["name"] for a in eng.list_loras()] == ["A", "B", "C"]
    # a (name, path) pair loads on first use; unloaded, the name is unknown again
    out = eng.generate([prompt(20, 6)], SamplingParams(max_tokens=TOKENS, lora=("A2", llama.dirs["A"])))[0]
    check_tokens(llama, prompt(20, 6), "A", out)
    assert eng.unload_lora("A2") is True
    with pytest.raises(InvalidRequest, match="unknown adapter 'A2'"):
        eng.add_request(prompt(20, 6), SamplingParams(lora="A2"))
    # the name loaded again from B's directory: another adapter, so none of A2's cached pages
    eng.load_lora("A2", llama.dirs["B"])
    out = eng.generate([prompt(20, 6)], SamplingParams(max_tokens=TOKENS, lora="A2"))[0]
    assert out.cached_tokens == 0
    check_tokens(llama, prompt(20, 6), "B", out)
    eng.unload_lora("A2")
    assert eng.stats()["pages_free"] == free


def test_adapters_survive_sleep_and_weight_updates(llama):
    """The slot tables are the engine's state, not the checkpoint's: sleep(2) with the
    weights discarded (reloaded from the checkpoint at wake) keeps them, and so does a
    weight update from the checkpoint or from a params tree without them."""
    from flax import nnx

    from jaxfill.engine.loading import build_model

    eng, ids = llama.engine, prompt(24, 8)
    params = lambda name: SamplingParams(max_tokens=TOKENS, lora=name)  # noqa: E731
    eng.generate([ids], params("A"))  # A on the device
    eng.sleep(level=2, discard=True)
    eng.wake()
    check_tokens(llama, ids, "A", eng.generate([ids], params("A"))[0])
    eng.update_weights(llama.base)
    check_tokens(llama, ids, "A", eng.generate([ids], params("A"))[0])
    eng.update_weights(nnx.split(build_model(eng.config, None, progress=False))[1])
    check_tokens(llama, ids, "B", eng.generate([ids], params("B"))[0])
    check_tokens(llama, ids, None, eng.generate([ids], params(None))[0])
