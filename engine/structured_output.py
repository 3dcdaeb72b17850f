"""Structured output: llguidance grammars that mask each constrained row's next token.

The host keeps one `LLMatcher` per constrained request. Before a step it writes the
row's allowed tokens as a packed bitmask (`[W]` int32 words, bit t of word t // 32 =
token t may be drawn) into the batch; the jitted sampler applies it with one `where`
(engine/sampler.py). An unconstrained row carries all ones, which is the identity, and a
batch with no constrained row skips the unpacking (one `lax.cond`). The scheduler
advances the matcher with each recorded token and ends the request when the grammar
can take no more (engine/scheduler/transitions.py).

Async scheduling: a constrained row's next mask needs its previous token, so the
scheduler never gives it a decode while a token of it is still in flight.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from jaxfill.engine.request import InvalidRequest, StructuredOutput

# JSON as json.dumps writes it: one space after ',' and ':', none elsewhere. llguidance's
# default allows any run of whitespace between tokens, which a small model can fill until
# max_tokens (seen with the tiny model: newline after newline); a schema's "x-guidance"
# overrides this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


CHECKED_GRAMMARS = 256  # checked constraints kept (repeated schemas skip the compile)


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's multi-line diagnostics as one line (gRPC status details, HTTP 400s)."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip() and line.strip() != "^")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _ByteTokens:
    """engine.tokenizer.ByteTokenizer as llguidance's TokenizerWrapper wants it: bytes per id."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) if i < 256 else b"<|special_%d|>" % i for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def llg_tokenizer(tokenizer, vocab_size: int):
    """An llguidance tokenizer over the model's whole vocabulary (ids past the tokenizer's
    own are never allowed)."""
    import llguidance

    if hasattr(tokenizer, "tok"):  # engine.tokenizer.HFTokenizer: the Rust tokenizer's JSON
        eos = list(tokenizer.eos_token_ids) or None
        return llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "decode_bytes"):  # engine.tokenizer.ByteTokenizer
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size)))
    raise InvalidRequest("structured_output", "needs a tokenizer; this engine runs on token ids only")


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    import llguidance

    field = f"structured_output.{so.kind}"
    try:
        if so.kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if so.kind == "json_object" else json.loads(so.spec)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if so.kind == "choice":
            return llguidance.grammar_from("choice", list(so.spec))
        return llguidance.grammar_from(so.kind, so.spec)  # regex; grammar: Lark or GBNF
    except (ValueError, TypeError) as e:
        raise InvalidRequest(field, _one_line(str(e)) or "is malformed") from None


class GrammarCompiler:
    """Checks constraints and makes matchers for one tokenizer (built on first use: about
    a second for a 128k vocabulary)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._llg = None
        # constraint -> its checked grammar: serving's validation, the factory's check and the
        # matcher would otherwise each compile the same schema
        self._checked: dict[StructuredOutput, str] = {}
        self._lock = threading.Lock()  # the serving event loop and the engine thread both check

    def _llg_for(self, tokenizer):
        if tokenizer is not self._tokenizer:
            self._llg, self._tokenizer = llg_tokenizer(tokenizer, self.vocab_size), tokenizer
            self._checked.clear()
        return self._llg

    def check(self, so: StructuredOutput, tokenizer) -> str:
        """The constraint's grammar; InvalidRequest naming the field when it is malformed."""
        import llguidance

        llg = self._llg_for(tokenizer)
        if so in self._checked:
            return self._checked[so]
        grammar = grammar_text(so)
        error = llguidance.LLMatcher.validate_grammar(grammar, llg)
        if error:
            raise InvalidRequest(f"structured_output.{so.kind}", _one_line(error))
        with self._lock:
            if len(self._checked) >= CHECKED_GRAMMARS:
                self._checked.pop(next(iter(self._checked)))  # the oldest
            self._checked[so] = grammar
        return grammar

    def matcher(self, grammar: str, tokenizer):
        import llguidance

        m = llguidance.LLMatcher(self._llg_for(tokenizer), grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest("structured_output", _one_line(m.get_error()))
        return m


def fill_bitmask(matcher, row: np.ndarray) -> None:  # row: [W] i32, C-contiguous
    """The tokens the matcher allows next, packed into `row`."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)


def advance(matcher, token: int) -> str | None:
    """Feeds a recorded token; "stop" once the grammar is complete (it takes nothing more,
    or it accepted EOS), "error" if the token broke it."""
    matcher.consume_token(token)
    if matcher.is_error():
        return "error"
    return "stop" if matcher.is_stopped() else None
