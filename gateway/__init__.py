"""An OpenAI-compatible HTTP gateway over the speculative client: `specdec gateway`."""

from gateway.app import GatewayConfig, create_app
from gateway.upstream import UpstreamConfig

__all__ = ["GatewayConfig", "UpstreamConfig", "create_app"]
