"""Unicron's shared package: generated API stubs (unicron.v1), config, logging, telemetry,
gRPC helpers, retry, Redis helpers, the Python client and the `unicron` CLI."""
