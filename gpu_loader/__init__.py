"""gpu_loader."""
