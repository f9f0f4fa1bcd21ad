"""Speculative decoding: proposers draft tokens for decoding sequences, the target model scores them in one step
and the sampler keeps the longest prefix it would have drawn itself (engine/model_runner.py `verify`)."""
