"""Client: round orchestration with KV-truncation bookkeeping, and a streaming API."""

from client.speculative import GenerationResult, IncompatibleModels, SpeculativeClient, StreamChunk

__all__ = ["GenerationResult", "IncompatibleModels", "SpeculativeClient", "StreamChunk"]
