"""One sampled token into a request's host state: ids, logprobs, text, stop conditions.

Pure Python on the engine thread; the Engine turns the result into a RequestOutput.
"""

from __future__ import annotations

from jaxfill.engine.request import Request


def append_token(req: Request, token: int, logprob: float, top_ids, top_logprobs,  # [N], [N]
                 now: float, max_model_len: int) -> tuple[str, str | None, dict | None]:
    """Records one token; returns (text safe to emit now, finish reason or None, logprob entry)."""
    p = req.params
    req.output_ids.append(token)
    if req.first_token is None:
        req.first_token = now
    req.last_token = now
    lp = None
    if req.logprobs is not None:
        n = p.logprobs
        lp = {"token_id": token, "logprob": float(logprob),
              "top": [(int(i), float(v)) for i, v in zip(top_ids[:n], top_logprobs[:n])]}
        req.logprobs.append(lp)
    new_text = req.detok.feed([token])
    reason = None
    if token in req.eos_token_ids or token in p.stop_token_ids:
        reason = "stop"
    elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        reason = "length"
    if reason is not None:
        new_text += req.detok.flush()
    emitted, hit = apply_stop_strings(req, new_text, final=reason is not None)
    return emitted, "stop" if hit else reason, lp


def apply_stop_strings(req: Request, new_text: str, final: bool) -> tuple[str, bool]:
    """Text safe to emit now, and whether a stop string ended the request. Text that could
    be the start of a stop string is held back until it cannot be."""
    stops = req.params.stop
    if not stops:
        req.text += new_text
        return new_text, False
    buf = req.pending_text + new_text
    cut = min((i for i in (buf.find(s) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
        req.pending_text = ""
        req.text += buf[:cut]
        return buf[:cut], True
    hold = 0
    if not final:
        for s in stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
    emit = buf[:len(buf) - hold]
    req.pending_text = buf[len(buf) - hold:]
    req.text += emit
    return emit, False
