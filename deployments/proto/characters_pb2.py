"""Deprecated alias of `deployments.api.proto.characters_pb2` (one release)."""

from deployments.api.proto.characters_pb2 import *  # noqa: F403
