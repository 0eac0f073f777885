"""What the agent and the collector share: the wire format, its limits and units."""
