"""embark/planner."""
