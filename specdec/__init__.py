"""specdec core: sampling math, verification, proposals, models and session state.

Nothing in this package imports grpc; the services are thin adapters around it.
"""

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound, SpecDecError

__all__ = [
    "InvalidArgument",
    "OutOfRange",
    "ResourceExhausted",
    "SamplingParams",
    "SessionBusy",
    "SessionNotFound",
    "SpecDecError",
]


def __getattr__(name: str):
    # torch on first use only: `specdec health` (a container's healthcheck, every few seconds)
    # imports this package and no model, and importing torch took 7-13 s on a busy 2-core host.
    if name == "SamplingParams":
        from specdec.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
