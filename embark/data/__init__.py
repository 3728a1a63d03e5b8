"""embark/data."""
