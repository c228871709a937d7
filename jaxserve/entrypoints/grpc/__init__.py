"""The gRPC front end: server (server, background), client, proto conversions (convert).

Generated protobuf code lives in pb/ (scripts/gen_protos.py). Importing this package does not
import jax or grpc; import the submodule you need.
"""
