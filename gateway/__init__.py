"""An OpenAI-compatible HTTP gateway over the speculative client: `specdec gateway`."""

from gateway.app import CORS, GatewayConfig, create_app
from gateway.upstream import UpstreamConfig

__all__ = ["CORS", "GatewayConfig", "UpstreamConfig", "create_app"]
