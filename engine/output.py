"""A sampled token's text: incremental detokenization, stop strings, logprob entries.

The ids half of a token (output_ids, timings, EOS / stop ids / max_tokens /
max_model_len) is the scheduler's (engine/scheduler/transitions.py) and always runs on
the engine thread. This half only makes what a client reads: `emit_text` runs it inline;
a serving loop takes it off the engine thread (Engine(defer_text=True),
serving/text_stage.py).
"""

from __future__ import annotations

from jaxfill.engine.request import Request, RequestOutput


def format_logprob(token: int, logprob: float, top_ids, top_logprobs,  # [N], [N]
                   n: int) -> dict:
    return {"token_id": token, "logprob": float(logprob),
            "top": [(int(i), float(v)) for i, v in zip(top_ids[:n], top_logprobs[:n])]}


def emit_text(req: Request, sampled, logprob: float, top_ids, top_logprobs,  # [N], [N]
              ) -> tuple[str, str | None, dict | None]:
    """The client's half of a recorded token (scheduler.update_from_output made `sampled`):
    (text safe to emit now, finish reason or None, logprob entry)."""
    token, reason = sampled.token, sampled.reason
    lp = None
    if req.logprobs is not None:
        lp = format_logprob(token, logprob, top_ids, top_logprobs, req.params.logprobs)
        req.logprobs.append(lp)
    emitted, hit = feed_text(req, req.params.stop, [token], final=reason is not None)
    return emitted, "stop" if hit else reason, lp


def token_output(req: Request, sampled, host, row: int,  # host: HostOutput of the step, row: the request's
                 defer_text: bool) -> tuple[RequestOutput, str | None]:
    """What a caller reads of one recorded token, and the finish reason (the ids' or a stop
    string's) for the engine to finish it with. defer_text: ids and raw logprobs only, the
    caller formats them (serving/text_stage.py)."""
    lp = raw = None
    if defer_text:
        text, reason = "", sampled.reason
        if req.logprobs is not None:
            n = req.params.logprobs
            raw = [(float(host.logprob[row]), host.top_ids[row][:n].tolist(), host.top_logprobs[row][:n].tolist())]
    else:
        text, reason, lp = emit_text(req, sampled, host.logprob[row], host.top_ids[row], host.top_logprobs[row])
    out = RequestOutput(req.request_id, [sampled.token], text, logprobs=[lp] if lp else None, raw_logprobs=raw,
                        num_cached_tokens=req.cached_tokens,
                        prompt_logprobs=req.prompt_logprobs if len(req.output_ids) == 1 else None,
                        index=req.index, parent_id=req.parent_id)
    return out, reason


def record_prompt_logprobs(scheds, prompt: tuple, rows: int) -> None:
    """A step's scored prompt rows (host arrays [R * rows], [R * rows, N] x 2, per replica
    in engine.batch.build_batch's order) into each request's prompt_logprobs; an entry
    already there (a preempted prompt computed again) is kept."""
    from jaxfill.engine.batch import prompt_logprob_positions

    logprob, top_ids, top_lps = prompt
    for replica, sched in enumerate(scheds):
        at = replica * rows
        for sch in sched.seqs:
            req = sch.req
            for p in prompt_logprob_positions(sch):
                if req.prompt_logprobs is not None and req.prompt_logprobs[p + 1] is None:
                    req.prompt_logprobs[p + 1] = format_logprob(req.prompt_ids[p + 1], logprob[at], top_ids[at],
                                                                top_lps[at], req.params.prompt_logprobs)
                at += 1


def feed_text(state, stops: tuple[str, ...], ids: list[int], final: bool) -> tuple[str, bool]:
    """Detokenizes ids into `state` (a Request or a TextState: .detok, .text, .pending_text);
    returns (text safe to emit now, whether a stop string ended it)."""
    new_text = state.detok.feed(ids)
    if final:
        new_text += state.detok.flush()
    return apply_stop_strings(state, stops, new_text, final)


class TextState:
    """A request's text, kept apart from the engine's Request (deferred text)."""

    def __init__(self, detok, stops: tuple[str, ...]):
        self.detok = detok
        self.stops = stops
        self.text = ""  # emitted (never includes a stop string)
        self.pending_text = ""  # held back: could be the start of a stop string


def apply_stop_strings(state, stops: tuple[str, ...], new_text: str, final: bool) -> tuple[str, bool]:
    """Text safe to emit now, and whether a stop string ended the request. Text that could
    be the start of a stop string is held back until it cannot be."""
    if not stops:
        state.text += new_text
        return new_text, False
    buf = state.pending_text + new_text
    cut = min((i for i in (buf.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        state.pending_text = ""
        state.text += buf[:cut]
        return buf[:cut], True
    hold = 0
    if not final:
        for s in stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
    emit = buf[:len(buf) - hold]
    state.pending_text = buf[len(buf) - hold:]
    state.text += emit
    return emit, False
