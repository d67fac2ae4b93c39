"""The machinery under the algorithm: the FSDP2 trainer, batching, checkpoints, memory, metrics, data, collectives."""
