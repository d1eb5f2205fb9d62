"""Client: round orchestration with KV-truncation bookkeeping, and a streaming API."""

from client.speculative import ClientClosed, GenerationResult, IncompatibleModels, SpeculativeClient, StreamChunk

__all__ = ["ClientClosed", "GenerationResult", "IncompatibleModels", "SpeculativeClient", "StreamChunk"]
