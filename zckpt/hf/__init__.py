"""Every Hugging Face name and format: weights file names and indexes, safetensors headers, shard plans."""
