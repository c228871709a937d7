"""Generated protobuf and gRPC modules for protos/jaxserve.proto (scripts/gen_protos.py).

Never edit these files by hand: change the .proto and regenerate.
"""
