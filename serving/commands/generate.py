"""`jaxfill generate`: prompts in, streamed text (or JSON lines) out."""

from __future__ import annotations

import dataclasses
import json
import sys

COMMAND = ("generate",)
HELP = "generate text for one or more prompts"


def add_arguments(p) -> None:
    from jaxfill.serving.cli import common_model_args

    common_model_args(p, multi_process=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (loading, compiling) on stderr; stdout is unaffected either way")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


# generate's own pool: at least this many pages, a power of two (see pool_for_prompts)
MIN_POOL_PAGES = 64
MAX_POOL_PAGES = 1024  # beyond: engine.num_pages = 0 sizes it from memory, as for serve


def pool_for_prompts(config, lengths: list[int], max_tokens: int, at_once: bool):
    """A one-shot run knows its whole workload, so with engine.num_pages = 0 (size from
    memory: a 4 GiB pool on CPU, held as RSS since its pages are NaN-filled) it takes the
    pages its prompts need instead: SmolLM2-135M's `generate` peak RSS went from 7.2 to
    1.9 GB (2026-12-07). The count is rounded up to a power of two (at least
    MIN_POOL_PAGES), because the pool's shape is part of every step program: prompts of
    similar sizes then share the compile cache. `at_once`: every prompt runs together
    (--json); otherwise one after another, so the largest decides."""
    e, m = config.engine, config.mesh
    if e.num_pages != 0:
        return config  # a preset's or --set's own count
    speculative = config.speculative.num_tokens if config.speculative.enabled else 0
    pages = [-(-(n + max_tokens + speculative) // e.page_size) for n in lengths]
    need = 1 + (sum(pages) if at_once else max(pages))  # page 0 is the null page
    total = MIN_POOL_PAGES
    while total < need:
        total *= 2
    total = max(-(-total // m.sequence) * m.sequence, 2 * m.sequence)  # dealt evenly over the context-parallel ranks
    if total > MAX_POOL_PAGES:
        return config
    return dataclasses.replace(config, engine=dataclasses.replace(e, num_pages=total))


def run(args) -> int:
    from jaxfill.engine.config import load_config
    from jaxfill.engine.engine import Engine
    from jaxfill.engine.loading import build_tokenizer, validate_prompt
    from jaxfill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed).validate()
    prompts = args.prompt or [_parse_ids(t) for t in args.prompt_ids]
    config = load_config(args.config, args.overrides, args.model)
    # Reject bad prompts before minutes of model build and bucket compilation.
    tokenizer = build_tokenizer(config) if args.prompt else None
    lengths = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        validate_prompt(ids, config.model.vocab_size, config.engine.max_model_len)
        lengths.append(len(ids))
    config = pool_for_prompts(config, lengths, args.max_tokens, at_once=args.json)
    # args.compile_cache: what the CLI set up (None: off), so the Engine keeps it; on exit
    # process 0 releases the followers
    # One-shot: a bucket compiles when a step first needs it, not all of them up front (a
    # checkpoint run has six, up to 8192 tokens x 64 sequences; a short answer uses one or two)
    with Engine(config, progress=not args.quiet, warmup=False, compile_cache=args.compile_cache) as engine:
        if not engine.is_leader:
            engine.follow()  # multi-process: process 0 prints the output
            return 0
        engine.warmup(progress=not args.quiet, buckets=False)
        _print_generations(engine, args, prompts, params)
    return 0


def _print_generations(engine, args, prompts, params) -> None:
    from jaxfill.engine.tokenizer import IdsOnlyTokenizer

    if isinstance(engine.tokenizer, IdsOnlyTokenizer):
        print(f"jaxfill: no tokenizer ({engine.tokenizer.reason}): text is not decoded; "
              "the token ids are in --json", file=sys.stderr, flush=True)
    if args.json:
        for completion in engine.generate(prompts, params):
            print(json.dumps({"token_ids": completion.token_ids, "text": completion.text,
                              "finish_reason": completion.finish_reason,
                              "prompt_tokens": completion.prompt_tokens}), flush=True)
        return
    for prompt in prompts:
        shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        print(f"\n>>> {shown}", file=sys.stderr, flush=True)
        for chunk in engine.stream(prompt, params):
            sys.stdout.write(chunk.new_text)
            sys.stdout.flush()
        print(flush=True)
