"""Triton kernels for LoRA on Mixture-of-Experts layers, with torch references and a vLLM plugin."""
