"""lockstep.metrics."""
