"""The `characters` command (entry point `deployments.cli:main`): the model-level commands of `characters.commands`
(demo, presets, bench) plus `serve` (`deployments.cli.serve`: a local Ray cluster with the whole service).
It may import every other part of `deployments`: nothing imports it."""

from deployments.cli.main import main

__all__ = ["main"]
