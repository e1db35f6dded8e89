"""The runtime: placing a plan's stages on Ray, the driver loop, how a run stops and resumes, and the
terminal display."""
