"""What every worker process runs around its engine: the engine loop thread, cache-event feed, metrics, health."""
