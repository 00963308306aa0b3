"""lockstep.eval."""
