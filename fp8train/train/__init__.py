"""Training: run config, model loading and parallelisms, AdamW and schedules, checkpoints, metrics, the loop,
and torchrun + FSDP2. Imported on first use (`fp8train.Trainer`, `fp8train.train`, ...)."""
