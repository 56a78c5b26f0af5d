"""The generated gRPC code of `characters.proto` (scripts/gen_proto.sh)."""
