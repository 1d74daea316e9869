"""The catalog of LoRA adapters: where their weights live, which versions exist, which serve."""
