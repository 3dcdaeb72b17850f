"""vllm.grpc.engine messages <-> jaxfill's SamplingParams, outputs and prefix-cache events.

Pure translation for serving/vllm_service.py. A field we cannot honour is refused
(BadField -> INVALID_ARGUMENT naming it) when it holds anything but its proto default or
the value the smg gateway fills in for every request (n = 1,
spaces_between_special_tokens = true, ...), so the gateway's requests pass and a
request that really asks for something we lack never runs without it.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zipfile

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from jaxfill.engine.request import SamplingParams
from jaxfill.serving import images
from jaxfill.serving.request_core import BadField, structured_from_proto

# vLLM's default when a request leaves temperature unset (OpenAI's too): sampling, not greedy.
DEFAULT_TEMPERATURE = 1.0
SP = "sampling_params."
# Files the gateway needs to build the tokenizer (GetTokenizer zips those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json", "chat_template.jinja")
TOKENIZER_CHUNK_BYTES = 1 << 20


NOT_BUILT = {cpb.VIDEO: "video", cpb.AUDIO: "audio"}
PIXELS_NOT_READ = ("router-preprocessed pixels are not read: jaxfill decodes images itself from media_refs "
                   "(data: URLs; smg sends those under --mm-processing worker, or auto)")


def check_request_fields(request: vpb.GenerateRequest) -> None:
    """The multimodal fields jaxfill does not read, refused by name: a preprocessed batch
    (mm_inputs, extra_mm_inputs), and video or audio of any kind. Images come as media_refs
    (media_ref_blobs); kv_transfer_params[_json] are serving/disagg.py's to check."""
    batches = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
    batches += [(f"extra_mm_inputs[{i}]", b) for i, b in enumerate(request.extra_mm_inputs)]
    for name, batch in batches:
        if batch.modality in NOT_BUILT:
            raise BadField(name, f"{NOT_BUILT[batch.modality]} input is not supported (images only; docs/vision.md)")
        raise BadField(name, PIXELS_NOT_READ)


def media_ref_blobs(refs: vpb.MediaRefs) -> list[bytes]:
    """The encoded images of media_refs, in prompt order (one placeholder each in the ids)."""
    if not refs.items:
        raise BadField("media_refs", "carries no items")
    for i, item in enumerate(refs.items):
        if item.modality in NOT_BUILT:
            raise BadField(f"media_refs.items[{i}]", f"{NOT_BUILT[item.modality]} input is not supported "
                                                     "(images only; docs/vision.md)")
    return [images.data_url_bytes(item.url, f"media_refs.items[{i}].url") for i, item in enumerate(refs.items)]


def data_parallel_rank(request: vpb.GenerateRequest, data: int) -> int | None:
    """The data replica the gateway pinned the request to (None: unset, the engine places
    it); `data` is mesh.data, which GetServerInfo reports as data_parallel_size."""
    if not request.HasField("data_parallel_rank"):
        return None
    rank = request.data_parallel_rank
    if not 0 <= rank < data:
        raise BadField("data_parallel_rank", f"must be in [0, {data}) (this worker's mesh.data), got {rank}")
    return rank


def sampling_from_proto(s: vpb.SamplingParams, room: int, vocab_size: int) -> SamplingParams:
    """room: tokens left after the prompt, the bound of an unset max_tokens."""
    if s.WhichOneof("constraint") == "structural_tag":
        raise BadField(SP + "structural_tag", "is not supported by jaxfill (json_schema, regex, grammar, "
                                              "json_object and choice are)")
    if s.HasField("prompt_logprobs") and s.prompt_logprobs < 0:
        raise BadField(SP + "prompt_logprobs", f"-1 (every token) is not supported; ask for 0 to 20, "
                                               f"got {s.prompt_logprobs}")
    if s.HasField("seed") and s.seed < 0:
        raise BadField(SP + "seed", f"must be non-negative, got {s.seed}")
    bad_stop = [t for t in s.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise BadField(SP + "stop_token_ids", f"token id {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    # skip_special_tokens, spaces_between_special_tokens and include_stop_str_in_output shape
    # only text, and this protocol returns token ids (the gateway detokenizes): any value is
    # honoured. A stop string ends the request the same way either way.
    return SamplingParams(
        n=max(1, s.n),  # serving/vllm_service.py fans n > 1 out into one request per sample
        max_tokens=s.max_tokens if s.HasField("max_tokens") else room,
        temperature=s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_k=s.top_k, top_p=s.top_p if s.top_p > 0 else 1.0, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        logprobs=s.logprobs if s.HasField("logprobs") else None, min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        truncate_prompt_tokens=s.truncate_prompt_tokens if s.HasField("truncate_prompt_tokens") else None,
        structured_output=structured_from_proto(s),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None)


def logprobs_to_proto(entries) -> vpb.OutputLogProbs:
    """RequestOutput / Completion logprob entries ({token_id, logprob, top: [(id, lp)]})."""
    out = vpb.OutputLogProbs()
    for e in entries or ():
        out.token_ids.append(int(e["token_id"]))
        out.token_logprobs.append(float(e["logprob"]))
        top = e.get("top") or ()
        out.top_logprobs.append(vpb.TopLogProbs(token_ids=[int(t) for t, _ in top],
                                                values=[float(v) for _, v in top]))
    return out


def input_logprobs_to_proto(prompt_ids, entries) -> vpb.InputLogProbs:
    """Completion.prompt_logprobs (None first, then {token_id, logprob, top}) -> InputLogProbs."""
    out = vpb.InputLogProbs()
    for token, e in zip(prompt_ids, entries):
        out.token_ids.append(int(token))
        out.token_logprobs.append(vpb.InputTokenLogProb() if e is None else
                                  vpb.InputTokenLogProb(value=float(e["logprob"])))
        top = (e or {}).get("top") or ()
        out.top_logprobs.append(vpb.TopLogProbs(token_ids=[int(t) for t, _ in top],
                                                values=[float(v) for _, v in top]))
    return out


def set_matched_stop(msg: vpb.GenerateComplete, completion, params: SamplingParams, tokenizer) -> None:
    """Which stop ended a "stop" request: a stop token id, or the stop string found where
    the emitted text ends (EOS leaves it unset, as vLLM does)."""
    if completion is None or completion.finish_reason != "stop" or not completion.token_ids:
        return
    last = completion.token_ids[-1]
    if last in params.stop_token_ids:
        msg.matched_token_id = last
        return
    if params.stop:
        rest = tokenizer.decode(completion.token_ids)[len(completion.text):]
        for s in params.stop:
            if rest.startswith(s):
                msg.matched_stop_str = s
                return


def hash_to_int64(h: bytes | None) -> int | None:
    """Our 16-byte page hash -> the proto's int64 block hash (its first 8 bytes, signed)."""
    return None if h is None else struct.unpack("<q", h[:8])[0]


_TIERS = {"device": cpb.KV_CACHE_TIER_DEVICE, "host": cpb.KV_CACHE_TIER_HOST, "disk": cpb.KV_CACHE_TIER_DISK}


def kv_batch_to_proto(batch, page_size: int) -> cpb.KvEventBatch:
    """(sequence, wall time, replica, events, first event id) from EngineLoop.subscribe_kv."""
    seq, t, replica, events, first_event_id = batch
    out = cpb.KvEventBatch(sequence_number=seq, timestamp=t, dp_rank=replica)
    for i, ev in enumerate(events):
        e = out.events.add(event_id=first_event_id + i)
        if ev[0] == "stored":  # ("stored", hash, parent, tokens[, tier])
            h, parent, tokens = ev[1:4]
            e.stored.blocks.add(block_hash=hash_to_int64(h), token_ids=tokens, block_size=page_size)
            if parent is not None:
                e.stored.parent_block_hash = hash_to_int64(parent)
            e.stored.tier = _TIERS[ev[4] if len(ev) > 4 else "device"]
            e.stored.locality = cpb.KV_CACHE_LOCALITY_LOCAL
        elif ev[0] == "removed":  # ("removed", hash[, tier])
            e.removed.block_hashes.append(hash_to_int64(ev[1]))
            e.removed.tier = _TIERS[ev[2] if len(ev) > 2 else "device"]
            e.removed.locality = cpb.KV_CACHE_LOCALITY_LOCAL
        else:
            e.cleared.SetInParent()
    return out


def tokenizer_zip(directory: str) -> tuple[bytes, str]:
    """The tokenizer files of `directory` as one zip, and its sha256 (GetTokenizer)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in TOKENIZER_FILES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                z.write(path, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()
