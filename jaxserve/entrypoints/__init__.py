"""How users reach the engine: the `jaxserve` command, the offline `LLM` API, the OpenAI HTTP
server (openai/) and the gRPC server and client (grpc/). Importing this package imports neither
jax nor a server framework; import the submodule you need.
"""
