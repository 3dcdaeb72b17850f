"""`jaxfill generate`: prompts in, streamed text (or JSON lines) out."""

from __future__ import annotations

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
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        validate_prompt(ids, config.model.vocab_size, config.engine.max_model_len)
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
