"""The OpenAI-compatible HTTP front end: pydantic protocol, serving (requests -> engine calls ->
responses and SSE), the ASGI gate (auth, body size) and the FastAPI server.
"""
