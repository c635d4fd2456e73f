"""Reading DSpark decoding: statistics of per-round logs (`round_logs`) and decoding studies
that time decoders side by side over held-out prompts (`study`)."""
