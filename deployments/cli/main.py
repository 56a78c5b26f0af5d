"""The `characters` command: the model-level commands from characters.commands, plus `serve`.

It lives in deployments/ because `serve` needs the serving layer, and characters/ never imports
upward."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from characters.commands import build_parser


def _add_serve(sub: Any) -> None:
    from deployments.cli.serve import build_parser as serve_arguments
    from deployments.cli.serve import run

    s = sub.add_parser("serve", help="run the HTTP/gRPC API on a local Ray cluster (or RAY_ADDRESS) until Ctrl-C")
    serve_arguments(s)
    s.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(_add_serve).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
