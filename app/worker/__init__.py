"""The HAT worker process: its app and settings (server) and the engine that batches every device's frames
through the middle layers."""
