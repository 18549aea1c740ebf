"""The serving engine: scheduler, compiled step executables, sampler, tokenizer, multi-host replay."""
