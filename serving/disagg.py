"""Prefill/decode roles for the vLLM protocol, as the smg gateway drives them in PD mode.

smg (NIXL mode, chosen from GetServerInfo.kv_connector = "NixlConnector") sends each
request first to a prefill worker with max_tokens=1, not streaming, and
kv_transfer_params_json = {"do_remote_decode": true, ...}; it relays the JSON our
`complete.kv_transfer_params_json` returns, merged with "do_remote_prefill": true, to a
decode worker inside the original request. What we put there (under "jaxfill"): the
prefill's transfer-server address and transfer id, the token count, the array shapes,
the KV layout, a digest of the prompt and the gRPC address to release the pages at.

Prefill: the request runs as usual but its pages are held (engine/disagg/handoff.py) and its
first len(prompt) - 1 rows offered. Decode: pull (bounded by engine.kv_transfer_timeout_s),
then admit the request with those rows computed; the last prompt token runs here and
draws the first output token. Either way the decode side then calls the prefill
worker's VllmEngine.Abort with "kvx-release:<transfer id>", which frees the held pages
at once; unreleased pages are freed after the timeout anyway (a dead decode worker).
Nothing is allocated on the decode side before the rows have arrived, so a failed or
timed-out pull has nothing to free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from jaxfill.engine.disagg.transfer import TransferFailed
from jaxfill.engine.validation import role_flags, validate
from jaxfill.serving.request_core import BadField

log = logging.getLogger("jaxfill.serving.disagg")

ROLES = ("prefill", "decode", "both")
KV_CONNECTOR = "NixlConnector"  # what makes smg relay kv_transfer_params_json (its NIXL mode)
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
RELEASE_PREFIX = "kvx-release:"
EXPIRE_EVERY_S = 0.25
POLL_S = 0.002


class Disagg:
    """One worker's role; `grpc_address` is set once the server listens (serve.py)."""

    def __init__(self, engine, loop, role: str = "both", host: str = "127.0.0.1"):
        if role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
        validate(engine.config, extra=role_flags(role))  # serve.py checked before loading; an Engine built otherwise
        self.engine, self.loop, self.role, self.host = engine, loop, role, host
        self.grpc_address: str | None = None
        self.timeout_s = float(engine.settings.kv_transfer_timeout_s)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._expirer: asyncio.Task | None = None
        self._warned = False  # Mooncake-style kv_transfer_params alone (parse)
        if role != "both":
            engine.enable_kv_transfer(host)

    # ------------------------------------------------------------------ requests
    def parse(self, request: vpb.GenerateRequest) -> dict | None:
        """kv_transfer_params_json -> dict (None when unset); refuses what this role cannot do.

        Mooncake-style `kv_transfer_params` (what smg mints for a MooncakeConnector worker)
        are accepted but carry only the prefill worker's host and bootstrap port, not the
        offer (transfer id, shapes, layout, prompt digest) the hand-off pulls by: beside
        kv_transfer_params_json they are unused, and alone they hand nothing over (the
        decode side computes the prompt itself, as for a passthrough relay; logged once).
        """
        if request.HasField("kv_transfer_params") and not request.kv_transfer_params_json and not self._warned:
            self._warned = True
            log.warning("kv_transfer_params (remote_host/remote_port) carry no jaxfill offer; the prompt is "
                        "computed on this worker. jaxfill hands KV over through kv_transfer_params_json "
                        "(smg's NIXL mode: workers report kv_connector %s)", KV_CONNECTOR)
        if not request.kv_transfer_params_json:
            return None
        try:
            kv = json.loads(request.kv_transfer_params_json)
        except ValueError as e:
            raise BadField("kv_transfer_params_json", f"is not JSON: {e}") from None
        if not isinstance(kv, dict):
            raise BadField("kv_transfer_params_json", "must be a JSON object")
        if kv.get("do_remote_decode") and kv.get("do_remote_prefill"):
            raise BadField("kv_transfer_params_json", "do_remote_decode and do_remote_prefill are exclusive")
        if kv.get("do_remote_decode") and self.role == "decode":
            raise BadField("kv_transfer_params_json", "this worker has --role decode; do_remote_decode "
                                                      "requests go to a prefill worker")
        if kv.get("do_remote_prefill") and self.role == "prefill":
            raise BadField("kv_transfer_params_json", "this worker has --role prefill; do_remote_prefill "
                                                      "requests go to a decode worker")
        if kv.get("do_remote_prefill") and kv.get("jaxfill") is not None and not isinstance(kv["jaxfill"], dict):
            raise BadField("kv_transfer_params_json", "jaxfill must be an object")
        return kv

    async def hold(self, rid: str, context) -> None:
        """Prefill: the request's pages outlive its finish (admit hook of the engine loop),
        unless held KV already fills engine.kv_transfer_max_held_share of the pool."""
        self.engine.enable_kv_transfer(self.host)  # here, bound to --kv-host, not on the stepping thread
        share, limit = self.engine.held_page_share(), float(self.engine.settings.kv_transfer_max_held_share)
        if share >= limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{share:.0%} of the KV pool is held for transfers not yet pulled "
                                f"(engine.kv_transfer_max_held_share = {limit:g}); retry shortly")

        def admit(engine, ids, params, request_id, priority, replica=None):
            engine.add_request(ids, params, request_id=request_id, priority=priority, replica=replica)
            engine.hold_pages(request_id)
        self.loop.admit_hooks[rid] = admit
        self.ensure_expirer()

    def offer_json(self, rid: str) -> str:
        """Prefill: the params the decode side needs ("" when nothing was offered)."""
        info = self.engine.take_kv_offer(rid)
        if info is None:
            return ""
        info["release_address"] = self.grpc_address
        return json.dumps({"do_remote_decode": False, "do_remote_prefill": True, "jaxfill": info})

    async def pull(self, rid: str, ids: list[int], kv: dict, context) -> None:
        """Decode: pulls the offered rows and registers the admit hook. Aborts the RPC with
        UNAVAILABLE when the rows do not arrive in time, FAILED_PRECONDITION when they cannot
        fit this engine; the prefill worker is told to release its pages in every case."""
        info = kv.get("jaxfill")
        if not info:
            return  # nothing was offered (a passthrough relay): compute the prompt here
        handoff = self.engine.enable_kv_transfer(self.host)
        try:
            try:
                arrays, n = await asyncio.get_running_loop().run_in_executor(None, handoff.pull, info, ids)
            except TransferFailed as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"kv_transfer_params_json: {e}")
            except (KeyError, TypeError, ValueError) as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"kv_transfer_params_json: malformed jaxfill offer ({e!r})")
            except Exception as e:  # noqa: BLE001 - e.g. the prefill worker's transfer server is gone
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"KV pull from {info.get('transfer_address')} failed: {e}")
            deadline = time.monotonic() + self.timeout_s
            while not all(a.is_ready() for a in arrays):
                if time.monotonic() >= deadline:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"KV pull from the prefill worker at {info.get('transfer_address')} "
                                        f"timed out after {self.timeout_s:g} s (engine.kv_transfer_timeout_s)")
                await asyncio.sleep(POLL_S)
        finally:
            self._release_remote(info)
        cached = int(info.get("cached_tokens", 0))

        def admit(engine, ids_, params, request_id, priority, replica=None):
            engine.add_prefilled_request(ids_, params, request_id, arrays, n, cached, priority, replica=replica)
        self.loop.admit_hooks[rid] = admit

    def release_offer_of(self, request) -> None:
        """Decode: a request refused before its pull (bad field, over-long, overloaded,
        cancelled) releases the prefill worker's held pages now, not at their timeout."""
        try:
            kv = json.loads(request.kv_transfer_params_json or "null")
            info = kv.get("jaxfill") if isinstance(kv, dict) and kv.get("do_remote_prefill") else None
        except (ValueError, AttributeError):
            return
        if isinstance(info, dict):
            self._release_remote(info)

    def forget(self, rid: str) -> None:
        self.loop.admit_hooks.pop(rid, None)

    # ------------------------------------------------------------------ releases
    def _release_remote(self, info: dict) -> None:
        addr, tid = info.get("release_address"), info.get("transfer_id")
        if not addr or tid is None:
            return
        asyncio.get_running_loop().create_task(self._send_release(addr, int(tid)))

    async def _send_release(self, addr: str, tid: int) -> None:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(addr)
        try:
            await vpb_grpc.VllmEngineStub(ch).Abort(vpb.AbortRequest(request_ids=[f"{RELEASE_PREFIX}{tid}"]),
                                                    timeout=5.0)
        except grpc.RpcError as e:  # the prefill side frees them after its timeout anyway
            log.warning("releasing KV transfer %d at %s failed: %s", tid, addr, e)

    def take_releases(self, request_ids) -> list[str]:
        """Abort RPC: applies the release ids among request_ids, returns the others."""
        rest = []
        for rid in request_ids:
            if rid.startswith(RELEASE_PREFIX):
                try:
                    tid = int(rid[len(RELEASE_PREFIX):])
                except ValueError:
                    continue
                self.loop.call_on_engine(lambda tid=tid: self.engine.release_held(tid))
            else:
                rest.append(rid)
        return rest

    def ensure_expirer(self) -> None:
        """Prefill: a task that frees offers nobody pulled in time, busy or idle."""
        if self._expirer is None or self._expirer.done():
            self._expirer = asyncio.get_running_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            handoff = self.engine.kv_handoff
            if handoff is not None and handoff.held:
                self.loop.call_on_engine(self.engine.expire_held)

    # ------------------------------------------------------------------ server info
    def server_info(self) -> dict:
        """GetServerInfo's connector fields: a `both` worker reports none, so smg routes it as
        a plain worker; prefill/decode report NIXL so smg relays the params between them."""
        if self.role == "both":
            return {}
        return {"kv_connector": KV_CONNECTOR, "kv_role": KV_ROLES[self.role]}
