"""The HAT worker process: its settings (settings), its app (server) and the engine that batches every device's
frames through the middle layers."""
