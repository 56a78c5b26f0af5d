"""The `characters` command: the model-level commands from characters.cli, plus `serve`.

It lives in deployments/ because `serve` needs the serving layer, and characters/ never imports
upward."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from characters.cli import build_parser


def _serve(args: argparse.Namespace) -> int:
    from deployments.cli.serve import run_serve

    return run_serve(args.config, args.host, args.port, args.grpc_port, args.livekit_dev)


def _add_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the HTTP/gRPC API on a local Ray cluster (or RAY_ADDRESS) until Ctrl-C")
    s.add_argument("--config", help="YAML service config (default: the embedded tiny preset on CPU)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--grpc-port", type=int, default=9000, help="gRPC port (default 9000; 0 turns gRPC off)")
    s.add_argument("--livekit-dev", action="store_true",
                   help="also start a development LiveKit server on loopback for the watch page (/watch/)")
    s.set_defaults(func=_serve)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(_add_serve).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
