"""lockstep.engine."""
