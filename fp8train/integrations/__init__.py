"""fp8train inside other training tools. `fp8train.integrations.hf`: transformers' Trainer and TRL's SFTTrainer.

Each integration imports its tool on first use, so `import fp8train` never needs them.
"""
