"""The method inside other software: transformers models (hf), tensor parallelism under torchrun (tp)."""
