"""The per-host sidecar: samples sensors, knows which jobs hold which devices, pushes batches."""
