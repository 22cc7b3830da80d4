"""Block-retrieval baselines (Quest, InfLLM): fp16 pages on the host, fetched by a per-block score."""
