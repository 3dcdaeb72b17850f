"""`jaxfill client`: one streamed request against a running `jaxfill serve`."""

from __future__ import annotations

import json
import sys

COMMAND = ("client",)
HELP = "send one streamed Generate request to a jaxfill server"


def add_arguments(p) -> None:
    p.add_argument("--address", default="127.0.0.1:50051")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text")
    src.add_argument("--prompt-ids", default=None, help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--wait-ready", type=float, default=None, metavar="SECONDS",
                   help="first wait up to SECONDS for the server's health to be SERVING (warm-up done)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tls-ca", default=None, help="PEM root certificate: connect with TLS")
    p.add_argument("--info", action="store_true", help="print GetModelInfo and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and stats")


def run(args) -> int:
    import grpc
    from google.protobuf import json_format

    from jaxfill.serving.client import Client

    if args.wait_ready is not None and args.wait_ready < 0:
        raise ValueError("--wait-ready must be >= 0 seconds")
    with Client(args.address, api_key=args.api_key, tls_ca=args.tls_ca) as c:
        try:
            if args.wait_ready is not None:
                c.wait_serving(args.wait_ready)
            if args.info:
                print(json_format.MessageToJson(c.model_info()))
                return 0
            prompt = args.prompt if args.prompt is not None else None
            if args.prompt_ids is not None:
                prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
            if prompt is None:
                prompt = "Hello"
            ids, pieces, complete = [], [], None
            for resp in c.stream(prompt, timeout=args.timeout, max_tokens=args.max_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 seed=args.seed, ignore_eos=args.ignore_eos):
                if resp.HasField("chunk"):
                    ids.extend(resp.chunk.token_ids)
                    pieces.append(resp.chunk.text)
                    if not args.json:
                        sys.stdout.write(resp.chunk.text)
                        sys.stdout.flush()
                else:
                    complete = resp.complete
        except grpc.RpcError as e:
            print(f"jaxfill client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except TimeoutError as e:
            print(f"jaxfill client: {e}", file=sys.stderr)
            return 1
    if args.json:
        out = {"token_ids": ids, "text": "".join(pieces),
               **json_format.MessageToDict(complete, preserving_proto_field_name=True)}
        print(json.dumps(out))
    else:
        print()
        print(f"[{complete.finish_reason}] prompt {complete.prompt_tokens} tokens, completion "
              f"{complete.completion_tokens}, cached {complete.cached_tokens}, ttft {complete.ttft_s * 1e3:.1f} ms, "
              f"total {complete.e2e_s * 1e3:.1f} ms", file=sys.stderr)
    return 0
