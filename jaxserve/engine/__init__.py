"""The engine: its loop (schedule -> execute -> update), the async wrapper the servers use, the
builder that wires model, page pool, scheduler and runner, and the output side (detokenizing,
RequestOutputs, metrics). It never touches device arrays itself.
"""
