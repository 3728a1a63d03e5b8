"""embark."""
