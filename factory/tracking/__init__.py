"""Tracking: where a run's params, metrics, trajectories and checkpoints are recorded (MLflow), and how
tracked runs are found again."""
