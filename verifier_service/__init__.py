"""Verifier service: the verify engine (engine.py) and its gRPC adapter (server.py)."""
