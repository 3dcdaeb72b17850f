"""The phases of one EngineCore.step(), and what each does when it fails.

    schedule  [lock]  the outbox aside: expired KV offers, a lost cache, the scheduler's
                      plan, linear-attention state copies, the bucket     -> a Launch
    restore   [lock]  host-tier pages (and snapshots) written back into the rows' pages
    build     [lock]  the batch (numpy), padded to the bucket
    run               the device call, which returns at once; the scheduler advances
    update            the tokens reach the host: per row the scheduler's update, the text

A phase that raises finishes that step's requests with "error" and the engine goes on; a
KV cache lost between donation and store (an error, an interrupt) is rebuilt at the next
schedule and the running requests recompute. EngineCore (engine/core.py) decides the order,
what runs outside the lock and what an interrupt rewinds; this class holds the counters
stats() reports and ends requests for both (`finish`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback

from jaxfill.engine.async_step import Launch
from jaxfill.engine.batch import build_batch, pick_bucket, stack_batches
from jaxfill.engine.kv_tier.restore import restore_rows
from jaxfill.engine.output import record_prompt_logprobs, token_output
from jaxfill.engine.pooling.vectors import add_part, vector
from jaxfill.engine.request import Request, RequestOutput
from jaxfill.models.linear_state import state_row


class StepPhases:
    def __init__(self, lock, runner, scheduler, disagg, settings, shapes, vocab_size: int):
        self._lock = lock  # the core's: _run and _update take it around their scheduler calls
        self.runner = runner
        self.scheduler = scheduler
        self.disagg = disagg
        self.settings = settings
        self.shapes = shapes
        self.vocab_size = vocab_size
        self.num_steps = 0  # steps whose tokens reached the host
        self.num_errors = 0  # steps that raised (their requests finished with "error")
        self.num_cache_resets = 0  # KV caches rebuilt (their running requests recomputed)

    def schedule(self, outputs: list[RequestOutput]) -> Launch | None:
        """[lock] The launch, or None when nothing runs."""
        self.disagg.expire()
        self.recover_cache()
        if self.runner.kv_offload is not None:
            self.runner.kv_offload.poll()  # saves that reached the host join the tier
        scheds = self.scheduler.schedule()  # one per data replica
        for req in (r for sched in scheds for r in sched.finished):  # no room in the pool even alone
            self.disagg.forget(req.request_id)  # never prefilled: nothing to offer
            outputs.append(self.finished_output(req))
        if not self._copy_states(scheds) or not any(sched.seqs for sched in scheds):
            return None
        shape = pick_bucket(self.shapes, max(sc.num_tokens for sc in scheds), max(len(sc.seqs) for sc in scheds))
        return Launch(scheds, shape, None)

    def _copy_states(self, scheds) -> bool:
        """[lock] Linear-attention state snapshots taken and restored, and held prefills'
        states exported, before the step (even when nothing runs now: a snapshot is
        findable from now on). If the copy fails the cache is rebuilt and every request
        recomputes (no snapshot is then trusted)."""
        pool = self.runner.config.engine.state_pool_slots
        row = lambda r, slot: state_row(pool, r, slot)  # noqa: E731 - scheds[r] is replica r's, its slots local
        first = [(row(r, a), row(r, b)) for r, sc in enumerate(scheds) for a, b in sc.state_copies]
        then = [(row(r, a), row(r, b)) for r, sc in enumerate(scheds) for a, b in sc.state_restores]
        # held prefills' states (engine/disagg/handoff.py)
        exports = [(i, row(r, slot)) for r, sc in enumerate(scheds) for i, slot in sc.state_exports]
        # snapshots the copies push out, to the host tier
        saves = [(row(r, slot), h) for r, sc in enumerate(scheds) for slot, h in sc.state_saves]
        if not first and not then and not exports and not saves:
            return True
        try:
            self.runner.save_states(saves)  # before the copies overwrite their slots
            if first or then:
                self.runner.copy_states(first, then)
            for request_id, slot in exports:
                self.disagg.keep_state(request_id, self.runner.export_state(slot))
            return True
        except Exception:  # noqa: BLE001 - the requests recompute; the engine goes on
            traceback.print_exc(file=sys.stderr)
            self._reset_cache()
            return False

    def restore(self, launch: Launch) -> Launch | None:
        """[lock] Rows that hit the host tier get their pages (and a hybrid's snapshot) back
        before the step reads them (engine/kv_tier/restore.py); one that failed recomputes,
        and a cache lost on the way sends everyone back (recover_cache)."""
        if restore_rows(self.runner, self.scheduler, launch.scheds):
            return launch
        if not self.runner.cache_ok():
            self.recover_cache()
            return None
        return launch if any(sc.seqs for sc in launch.scheds) else None

    def build(self, launch: Launch, outputs: list[RequestOutput]) -> Launch | None:
        """[lock]"""
        s = self.settings
        try:
            launch.batch = stack_batches([build_batch(sc, launch.shape, s.page_size, s.max_pages_per_seq,
                                                      self.vocab_size, s.penalty_window, self.runner.prompt_rows,
                                                      s.state_slots > 0, self.runner.verify_rows,
                                                      pool=not self.runner.has_head,
                                                      lora=self.runner.config.lora.enabled, mtp=self.runner.mtp)
                                          for sc in launch.scheds])
            vision = self.runner.vision
            if vision is not None:  # one replica (the capability table refuses mesh.data with images)
                launch.batch = dataclasses.replace(launch.batch, vision=vision.rows(launch.scheds[0].seqs,
                                                                                    launch.shape[0]))
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
            outputs += self.fail(launch.scheds, e)
            return None
        return launch

    def run(self, launch: Launch, outputs: list[RequestOutput]) -> Launch | None:
        try:
            launch.pending = self.runner.run(launch.batch)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                outputs += self.fail(launch.scheds, e)
            return None
        with self._lock:
            self.scheduler.on_dispatch(launch.scheds, launch.shape[1])
        return launch

    def update(self, launch: Launch, outputs: list[RequestOutput], done: set, defer_text: bool) -> None:
        """Step N's results reach the host: per row, the scheduler's update, then the text
        (ids only with `defer_text`). `done` gets the id() of each row taken."""
        try:
            host = launch.pending.get()
        except Exception as e:  # noqa: BLE001
            with self._lock:
                outputs += self.fail(launch.scheds, e)
                return
        with self._lock:
            self.num_steps += 1
            now = time.perf_counter()
            if host.prompt is not None:
                record_prompt_logprobs(launch.scheds, host.prompt, self.runner.prompt_rows)
            verified = launch.shape[1]  # verification rows follow the S sampled rows (one replica)
            for sch, row in launch.rows():
                req = sch.req
                try:
                    if req.pooling is not None:
                        out = self._pooled_output(sch, host, row)
                        done.add(id(sch))
                        if out is not None:
                            outputs.append(out)
                        continue
                    if sch.draft:
                        rows = [verified + j for j in range(len(sch.draft))] + [row]
                        verified += len(sch.draft)
                        outputs += self._verified_outputs(sch, host, rows, now, defer_text)
                        done.add(id(sch))
                        self._keep_mtp(sch, host, row)
                        continue
                    sampled = self.scheduler.update_from_output(sch, int(host.tokens[row]), now)
                    self._keep_mtp(sch, host, row)
                    out = None if sampled is None else self._token_output(req, sampled, host, row, defer_text)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    out = self.finish(req, "error", error=f"{type(e).__name__}: {e}")
                done.add(id(sch))
                if out is not None:
                    outputs.append(out)

    @staticmethod
    def _keep_mtp(sch, host, row: int) -> None:
        """[lock] The MTP proposer's guess from this step's last accepted row of the request,
        kept with the number of tokens it follows (engine/speculative/mtp_step.py): its row at
        position p guessed the token at p + 2, so it is the next proposal only when the
        request holds p + 2 tokens now (a partial prefill's guess never is)."""
        if host.mtp is None or sch.req.finished:
            return
        req = sch.req
        accepted = req.num_tokens - (sch.start + sch.num_new - len(sch.draft)) - 1 if sch.draft else 0
        p = sch.start + sch.num_new - len(sch.draft) - 1 + accepted  # the last accepted row's position
        req.mtp_draft = (int(host.mtp[row]), p + 2)

    def _pooled_output(self, sch, host, row: int) -> RequestOutput | None:
        """[lock] A pooling request's chunk: its sum kept; at the prompt's end it finishes with
        its vector (engine/pooling/vectors.py), pages freed, no token drawn."""
        if sch.req.finished:
            return None
        add_part(sch.req, sch.start, sch.num_new, host.pooled[row])
        if not self.scheduler.update_pooled(sch):
            return None
        sch.req.embedding = vector(sch.req)
        return self.finish(sch.req, "stop")

    def _verified_outputs(self, sch, host, rows: list[int], now: float, defer_text: bool) -> list[RequestOutput]:
        """[lock] A decode that verified proposals: its emitted tokens one output each, in
        order, as if they had come one per step; the first that finishes it (EOS, stop
        ids, max_tokens, a stop string) ends it and drops the rest."""
        emitted = self.scheduler.verify(sch, [int(host.tokens[r]) for r in rows])
        outs = []
        for j, token in enumerate(emitted):
            out = self._token_output(sch.req, self.scheduler.record_verified(sch, token, now), host, rows[j],
                                     defer_text)
            outs.append(out)
            if out.finished:
                break
        self.scheduler.settle(sch, len(outs))
        return outs

    def _token_output(self, req: Request, sampled, host, row: int, defer_text: bool) -> RequestOutput:
        out, reason = token_output(req, sampled, host, row, defer_text)
        if reason is not None:
            out.finished, out.completion = True, self.finish(req, reason).completion
        return out

    def recover_cache(self) -> None:
        """A step that died between donating the KV cache and storing its successor (an
        error, or an interrupt) leaves deleted buffers: start from a fresh cache and send
        the running requests back to be recomputed, so no later request fails for it."""
        if not self.runner.cache_ok():
            self._reset_cache()

    def _reset_cache(self) -> None:
        self.runner.reset_cache()
        self.scheduler.recompute_all()
        self.num_cache_resets += 1

    def fail(self, scheds, exc: Exception) -> list[RequestOutput]:
        """[lock] The step raised: its requests finish with "error"; the engine carries on."""
        self.num_errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        outs = [self.finish(sch.req, "error", error=msg)
                for sched in scheds for sch in sched.seqs if not sch.req.finished]
        self.recover_cache()
        return outs

    def finish(self, req: Request, reason: str, error: str | None = None,
               num_output_tokens: int | None = None) -> RequestOutput:
        """[lock] Ends the request through the scheduler; a held prefill keeps its pages for
        the decode side's pull (engine/disagg/handoff.py)."""
        keep = self.disagg.take_on_finish(req, reason)
        self.scheduler.finish(req, reason, error, keep_pages=keep, num_output_tokens=num_output_tokens)
        return self.finished_output(req)

    @staticmethod
    def finished_output(req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, [], "", finished=True, completion=req.completion(), index=req.index,
                             parent_id=req.parent_id)
