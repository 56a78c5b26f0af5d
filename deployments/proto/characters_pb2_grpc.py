"""Deprecated alias of `deployments.api.proto.characters_pb2_grpc` (one release)."""

from deployments.api.proto.characters_pb2_grpc import (
    CharactersServicer,
    CharactersStub,
    add_CharactersServicer_to_server,
)

__all__ = ["CharactersServicer", "CharactersStub", "add_CharactersServicer_to_server"]
