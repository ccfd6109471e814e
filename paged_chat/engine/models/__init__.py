"""Model loading (aliases, GGUF, HF folders, hub ids) and the llama-family decoder."""
