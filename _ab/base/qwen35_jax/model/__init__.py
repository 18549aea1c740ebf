"""The model: HF config, checkpoint, sharded weights and state, the forward, and the kernel backends."""
