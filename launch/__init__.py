"""launch: the torchrun trainer (`python -m launch.train`), its config, data, schedule, metrics, and HF interop."""
