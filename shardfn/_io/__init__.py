"""Input and output: sharded checkpoints and Hugging Face weights.

checkpoint saves and loads through torch.distributed.checkpoint; pretrained reads
safetensors straight into shards, and export writes them back (safetensors).
"""
