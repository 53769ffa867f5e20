"""Torch-free types shared by the router, the proto conversions and the engine: sampling parameters, request
outputs, generation defaults, block hashes, the model config from `config.json`, tokenizer and text stream.

Nothing here imports torch or another hybridserve package, so the router loads it without the engine."""
