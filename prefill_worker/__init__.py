"""The prefill service: chunked prefill with its prefix cache, state export and streaming to decode."""
