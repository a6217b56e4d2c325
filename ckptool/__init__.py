"""ckptool: one canonical GPT state between Megatron, DeepSpeed and Hugging Face checkpoints."""
__version__ = "0.1.0"
