"""Generated gRPC stubs for protos/specdec/v1 (regenerate with `python -m specdec_rpc.generate`).

Kept outside the core package `specdec`, which never imports grpc.
"""
