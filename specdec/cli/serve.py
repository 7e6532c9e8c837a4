"""``specdec serve``: an OpenAI-compatible HTTP server over the engine."""

from __future__ import annotations

import os
import signal
import sys

from specdec.cli.common import (
    PROG,
    add_model_args,
    add_spec_args,
    engine_kwargs,
    float_at_least,
    int_at_least,
)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_at_least(0), default=8000,
                   help="TCP port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health; "
                        "repeat for several keys, each a tenant with its own prefix cache "
                        "(default: $SPECDEC_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--max-model-len", type=int_at_least(2), default=None,
                   help="most tokens (prompt + completion) a request may hold; longer prompts "
                        "get 400 (default: the model's context length, at most 4096)")
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=32,
                   help="requests decoded together in one batch; more wait in the queue "
                        "(default 32)")
    p.add_argument("--max-queued", type=int_at_least(1), default=256,
                   help="requests waiting beyond this get 503 with Retry-After (default 256)")
    p.add_argument("--max-tokens-limit", type=int_at_least(1), default=None,
                   help="largest max_tokens a request may ask (default: max_model_len)")
    p.add_argument("--max-body-bytes", type=int_at_least(1), default=1 << 20,
                   help="largest request body accepted; larger get 413 (default 1 MiB)")
    p.add_argument("--drain-timeout", type=float_at_least(0), default=30.0,
                   help="on SIGTERM: seconds running requests may take to finish (new ones "
                        "get 503); those still running then end with an error (default 30)")
    add_model_args(p)
    add_spec_args(p, drafter_help="registered drafter name, or none (default: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.engine.llm import LLM
    from specdec.serving.engine_loop import EngineLoop
    from specdec.serving.server import ServerLimits, ServerThread, create_app

    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              **engine_kwargs(args))
    loop = EngineLoop(llm.engine, max_queued=args.max_queued)
    keys = args.api_key or [k for k in [os.environ.get("SPECDEC_API_KEY")] if k]
    app = create_app(loop, args.served_model_name or args.model, keys,
                     ServerLimits(args.max_body_bytes, args.max_tokens_limit))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print(f"{PROG} serve: warning: listening on {args.host} without an API key",
              file=sys.stderr)
    server = ServerThread(app, args.host, args.port, log_level="info")
    print(f"{PROG} serve: {server.url}/v1 (Ctrl-C stops; SIGTERM drains for up to "
          f"{args.drain_timeout:g} s, then stops)", file=sys.stderr)
    drain_on_sigterm(loop, args.drain_timeout)
    try:
        loop.run()  # the engine steps in the thread that built it; HTTP runs in another
    except KeyboardInterrupt:
        pass
    finally:
        loop.shutdown()
        server.stop()
        llm.close()  # the engine's memory, its tier file, a tensor-parallel engine's workers
    return 0


def drain_on_sigterm(loop, timeout: float) -> None:
    """On SIGTERM (e.g. docker stop) new requests get 503 and running ones finish (or time out
    after ``timeout`` s); then ``loop.run()`` returns. The handler only asks the loop
    (``EngineLoop.drain_soon``): it runs on the main thread, which steps the engine and may hold
    one of the loop's locks at that moment."""
    signal.signal(signal.SIGTERM, lambda *_: loop.drain_soon(timeout))
