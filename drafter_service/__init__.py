"""Drafter service: the draft engine (engine.py) and its gRPC adapter (server.py)."""
