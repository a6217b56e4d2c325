"""Hugging Face model folders (config.json + safetensors): reader, writer, config mapping, and the torch-free quick part for inspect."""
