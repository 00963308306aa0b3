"""lockstep.train."""
