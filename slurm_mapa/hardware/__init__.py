"""Building hardware graphs: presets, topology files, nvidia-smi text, NVML."""
