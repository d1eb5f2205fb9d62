"""Client: round orchestration with KV-truncation bookkeeping, and a streaming API."""

from client.speculative import (ClientClosed, GenerationResult, IncompatibleModels, NoServerAvailable,
                                SpeculativeClient, StreamChunk)

__all__ = ["ClientClosed", "GenerationResult", "IncompatibleModels", "NoServerAvailable", "SpeculativeClient",
           "StreamChunk"]
