"""The decode service: reservations, state import, continuous batching, token streaming."""
