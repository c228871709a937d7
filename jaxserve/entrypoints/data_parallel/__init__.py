"""Data parallelism on one host: N engine processes ("ranks") behind the one gRPC/HTTP front end
(`jaxserve serve --data-parallel-size N`). router.py picks a rank per request, wire.py is the
message format between the front end and the ranks, rank.py is a rank process, client.py the
front end's side of them, metrics.py their Prometheus families with a rank label."""
