"""Building blocks of the DeepSeek-V4 model, one concept per file."""
