"""Generated protobuf/gRPC code for package ``kvd.v1`` (do not edit).

Made from ``proto/kvd/v1/*.proto`` by ``scripts/gen_proto.sh``;
``tests/test_proto_drift.py`` fails when these files drift from the .proto.
"""
