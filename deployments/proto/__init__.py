"""Deprecated alias of `deployments.api.proto`, kept for one release (0.2): manifests naming
`deployments.proto.characters_pb2_grpc.add_CharactersServicer_to_server` still work; write
`deployments.api.proto.characters_pb2_grpc.add_CharactersServicer_to_server` instead."""
