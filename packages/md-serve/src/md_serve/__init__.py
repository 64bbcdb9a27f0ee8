"""md-serve."""
