"""specdec core: sampling math, verification, proposals, models and session state.

Nothing in this package imports grpc; the services are thin adapters around it.
"""

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted, SessionBusy, SessionNotFound, SpecDecError
from specdec.sampling import SamplingParams

__all__ = [
    "InvalidArgument",
    "OutOfRange",
    "ResourceExhausted",
    "SamplingParams",
    "SessionBusy",
    "SessionNotFound",
    "SpecDecError",
]
