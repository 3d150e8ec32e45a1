"""Models written once on the global view: plain PyTorch plus logical axis names."""
