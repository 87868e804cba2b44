"""`rca bench ...`: commands that print figures (never timed tests)."""
