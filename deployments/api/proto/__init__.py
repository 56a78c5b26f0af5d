"""The generated gRPC code of `characters.proto` (scripts/setup/gen_proto.sh)."""
