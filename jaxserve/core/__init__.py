"""The scheduler side: requests, the page pool, the scheduler and the plan it hands the runner.

Plain Python over integers and numpy; nothing here imports jax (tests/test_import_rules.py).
"""
