"""Text for the engine's deferred outputs, made off the engine thread (on the event loop).

With `Engine.defer_text` the engine thread only records ids and the stops scheduling needs
(EOS, stop ids, max_tokens, max_model_len). This stage, fed each request's outputs in
order, does what only clients read: incremental detokenization, stop strings (text that
could start one is held back, as engine/output.py does inline) and logprob formatting.

A stop string is found here, after the engine may have computed (and sent) more tokens:
the stage emits the text before the stop and the tokens up to the one that completed it,
returns that token count so the caller can have the engine finish the request
(`Engine.stop_at`), drops whatever comes after, and turns the engine's final output into
a "stop" completion cut at that count. What a client sees equals the inline path's.
"""

from __future__ import annotations

import dataclasses

from jaxfill.engine.output import TextState, feed_text, format_logprob
from jaxfill.engine.request import RequestOutput, SamplingParams


@dataclasses.dataclass
class _Stream:
    text: TextState
    num_logprobs: int | None
    tokens: list[int] = dataclasses.field(default_factory=list)  # emitted so far
    logprobs: list[dict] | None = None
    stop_at: int | None = None  # tokens kept when a stop string ended it


class TextStage:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._streams[request_id] = _Stream(TextState(self.tokenizer.detokenizer(prompt_ids), params.stop),
                                            params.logprobs, logprobs=[] if params.logprobs is not None else None)

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def render(self, out: RequestOutput) -> tuple[RequestOutput | None, int | None]:
        """(the output a client gets, or None to drop it; the token count to stop the
        request at when a stop string just ended it, else None)."""
        st = self._streams.get(out.request_id)
        if st is None:
            return out, None
        if st.stop_at is not None:  # only the engine's final output gets through, emptied
            if not out.finished:
                return None, None
            return self._final(dataclasses.replace(out, new_token_ids=[], new_text="", logprobs=None,
                                                   raw_logprobs=None), st), None
        lps = None
        if st.logprobs is not None:
            lps = [format_logprob(t, lp, ids, vals, st.num_logprobs)
                   for t, (lp, ids, vals) in zip(out.new_token_ids, out.raw_logprobs or [])]
            st.logprobs += lps
        text, hit = "", False
        if out.new_token_ids:
            text, hit = feed_text(st.text, st.text.stops, out.new_token_ids, final=out.finished)
        st.tokens += out.new_token_ids
        out = dataclasses.replace(out, new_text=text, logprobs=lps or None, raw_logprobs=None)
        if hit:
            st.stop_at = len(st.tokens)
        if out.finished:
            return self._final(out, st), None
        return out, st.stop_at

    @staticmethod
    def _final(out: RequestOutput, st: _Stream) -> RequestOutput:
        c = out.completion
        if c is None:
            return out
        fix = {"text": st.text.text}
        if st.logprobs is not None:
            fix["logprobs"] = st.logprobs[:len(st.tokens)]
        if st.stop_at is not None:
            fix.update(token_ids=c.token_ids[:st.stop_at], finish_reason="stop")
        return dataclasses.replace(out, completion=dataclasses.replace(c, **fix))
